"""A fork server for the trainer scripts: imports the frameworks once, forks a trainer per run.

usage: _forkserver.py SOCKET MODULE...

Importing torch and a framework costs a trainer process seconds before its first line runs
(megatron-core about eight on this suite's machines), and a test launches two to four of them.
This process imports ``MODULE...`` once, then serves runs over the Unix socket ``SOCKET``:
one connection per run, one JSON line ``{"script", "args", "env", "cwd", "stdout",
"stderr"}``. For each it forks a monitor, which forks the trainer and answers two JSON
lines: ``{"pid": N}`` once the trainer exists, ``{"returncode": N}`` once it has ended
(negative: killed by that signal, as :mod:`subprocess` reports it).

The trainer is then what ``python SCRIPT ARGS`` started with that environment, in that
directory, would be once it had imported ``MODULE...`` itself: its own process and session
(the test kills the group on a timeout), ``sys.argv`` and ``sys.path[0]`` as a script gets
them, stdout and stderr in the files named, and a normal interpreter exit (``atexit``
handlers, the exit code of an exception or ``sys.exit``). The server stays single-threaded and
never imports ckptcache, so a fork copies no lock held elsewhere and no setting read from an
earlier test's environment; both are checked before every fork.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import socket
import sys
import threading


def _reap() -> None:
    """Collect the monitors that have ended (they are this process's only children)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _become_trainer(req: dict) -> None:
    """In the trainer: take the run's session, directory, environment, streams and argv."""
    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [req["script"], *req["args"]]
    sys.path[0] = os.path.dirname(req["script"])


def _monitor(conn: socket.socket, req: dict) -> None:
    """In the monitor: start the trainer, report its pid and then its exit; never returns in
    the monitor (only in the trainer, which goes on to run the script)."""
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_trainer(req)
        return
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:
        os._exit(0)


def serve(path: str) -> dict:
    """Serve runs until a ``{"exit": true}`` request; returns (in a trainer) its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # the socket appears once it takes connections
    while True:
        conn, _ = listener.accept()
        _reap()
        with conn.makefile("rb") as f:
            req = json.loads(f.readline())
        if req.get("exit"):
            conn.close()
            listener.close()
            os.unlink(path)
            os._exit(0)  # nothing to flush; tearing down torch and a framework takes seconds
        # What makes a fork a faithful fresh start; a failed check ends the server (the test
        # side then reports its log) rather than hand out a doubtful trainer.
        assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
        assert "ckptcache" not in sys.modules
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _monitor(conn, req)
            return req
        conn.close()


if __name__ == "__main__":
    for name in sys.argv[2:]:
        importlib.import_module(name)
    run = serve(sys.argv[1])
    runpy.run_path(run["script"], run_name="__main__")
