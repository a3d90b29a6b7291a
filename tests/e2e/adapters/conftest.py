"""Fixtures for the framework adapter tests: trainer scripts run in their own processes."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.adapters.scripts._dist import DEEPSPEED, MEGATRON
from tests.helpers import REPO, DaemonProc, wait_until

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(scope="session", autouse=True)
def torch_extensions_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private ``TORCH_EXTENSIONS_DIR`` for every trainer this run starts.

    Nothing should be compiled (the DeepSpeed trainers disable the ops that would be), and if
    something ever is, it neither waits on nor corrupts the shared ``~/.cache/torch_extensions``
    lock of other runs on the machine.
    """
    path = tmp_path_factory.mktemp("torch_extensions")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(path))
        yield path


def free_port() -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_env(daemon: DaemonProc | None) -> dict[str, str]:
    """Environment of a trainer process that talks to ``daemon`` (or to none)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["CKPTCACHE_SOCKET"] = daemon.socket if daemon else "/nonexistent/ckptcache.sock"
    return env


#: What each trainer script imports before anything of ckptcache (see :func:`preload_of`).
TORCH = ("torch", "torch.multiprocessing", "torch.distributed")
FRAMEWORKS = {
    "ds_": (*TORCH, *DEEPSPEED),
    "megatron_": (*TORCH, *MEGATRON),
    # Lightning's fit builds a torch optimizer, whose first construction imports dynamo.
    "lightning_": (*TORCH, "lightning", "torch._dynamo"),
    "dcp_": (
        *TORCH,
        "torch.distributed.checkpoint",
        "torch.distributed.device_mesh",
        "torch.distributed.tensor",
    ),
}


def preload_of(name: str) -> tuple[str, ...]:
    """The modules the script ``name`` imports before anything of ckptcache: its launcher's
    own imports, the framework it preloads for its ranks and what the framework imports
    lazily on the way. The fork server that runs it has imported exactly these."""
    for prefix, modules in FRAMEWORKS.items():
        if name.startswith(prefix):
            return modules
    return TORCH


class Trainer:
    """A trainer started by a fork server: :meth:`poll` and :meth:`wait` as on a
    ``subprocess.Popen`` whose output is captured."""

    def __init__(
        self, cmd: list[str], pid: int, conn: socket.socket, reply: Any, out: Path, err: Path,
        server_log: str,
    ) -> None:  # fmt: skip
        self.cmd, self.pid, self.returncode = cmd, pid, None
        self._conn, self._reply, self._out, self._err = conn, reply, out, err
        self._server_log = server_log

    def poll(self) -> int | None:
        """The exit code once the trainer has ended, else None."""
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Wait for the end (on a timeout: kill the trainer and its ranks, raise
        ``subprocess.TimeoutExpired``) and return the exit code and output."""
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self._close()
                raise subprocess.TimeoutExpired(self.cmd, timeout)
            self._read_exit()
        return subprocess.CompletedProcess(
            self.cmd, self.returncode, self._out.read_text(), self._err.read_text()
        )

    def _read_exit(self) -> None:
        line = self._reply.readline()
        self._close()
        if not line:  # the monitor itself died: report what the server logged
            raise RuntimeError(f"fork server lost {self.cmd[1:]}: {self._server_log}")
        self.returncode = json.loads(line)["returncode"]

    def _close(self) -> None:
        self._reply.close()
        self._conn.close()


class ForkServers:
    """One fork server (``scripts/_forkserver.py``) per set of preloaded modules, started on
    first use and stopped at the end of the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.servers: dict[tuple[str, ...], tuple[subprocess.Popen[bytes], str]] = {}
        self.runs = 0

    def socket_for(self, preload: tuple[str, ...]) -> str:
        if preload not in self.servers:
            where = self.root / f"fs{len(self.servers)}"
            where.mkdir()
            path = str(where / "fork.sock")
            # The server's own environment carries no ckptcache setting: each run brings the
            # whole environment of its test.
            env = {k: v for k, v in daemon_env(None).items() if not k.startswith("CKPTCACHE_")}
            log = open(where / "server.log", "wb")  # noqa: SIM115 - owned by the child
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPTS / "_forkserver.py"), path, *preload],
                env=env, cwd=REPO, stdout=log, stderr=log,
            )  # fmt: skip
            log.close()
            self.servers[preload] = (proc, path)
            wait_until(lambda: self._connectable(proc, where), 240, f"fork server {preload}")
        return self.servers[preload][1]

    @staticmethod
    def _connectable(proc: subprocess.Popen[bytes], where: Path) -> bool:
        if proc.poll() is not None:
            raise RuntimeError("fork server died: " + (where / "server.log").read_text())
        return (where / "fork.sock").exists()

    def start(
        self, preload: tuple[str, ...], script: Path, args: tuple[str, ...], env: dict[str, str]
    ) -> Trainer:
        """Start ``script args`` as a fresh trainer of the server for ``preload``."""
        path = self.socket_for(preload)
        self.runs += 1
        out = self.root / f"run{self.runs}.out"
        err = self.root / f"run{self.runs}.err"
        req = {"script": str(script), "args": list(args), "env": env, "cwd": str(REPO),
               "stdout": str(out), "stderr": str(err)}  # fmt: skip
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(path)
        conn.sendall(json.dumps(req).encode() + b"\n")
        reply = conn.makefile("rb")
        first = reply.readline()
        if not first:
            raise RuntimeError(f"fork server refused {script.name}: {self.log(preload)}")
        cmd = [sys.executable, str(script), *args]
        return Trainer(cmd, json.loads(first)["pid"], conn, reply, out, err, self.log(preload))

    def log(self, preload: tuple[str, ...]) -> str:
        """The end of the server's own output (a failed check, a traceback)."""
        return (Path(self.servers[preload][1]).parent / "server.log").read_text()[-5000:]

    def stop(self) -> None:
        for proc, path in self.servers.values():
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                s.sendall(b'{"exit": true}\n')
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_FORK_SERVERS: ForkServers | None = None


@pytest.fixture(scope="session", autouse=True)
def fork_servers(
    tmp_path_factory: pytest.TempPathFactory, torch_extensions_dir: Path
) -> Iterator[ForkServers]:
    """The session's fork servers (after ``torch_extensions_dir``: they inherit it)."""
    global _FORK_SERVERS
    _FORK_SERVERS = ForkServers(tmp_path_factory.mktemp("forkservers"))
    yield _FORK_SERVERS
    _FORK_SERVERS.stop()
    _FORK_SERVERS = None


def start_script(name: str, *args: str, daemon: DaemonProc | None = None) -> Trainer:
    """Start ``scripts/<name>`` with ``args`` as a fresh trainer process (forked by the
    session's fork server for what the script imports first), without waiting for it."""
    assert _FORK_SERVERS is not None, "trainers need the fork_servers fixture"
    return _FORK_SERVERS.start(preload_of(name), SCRIPTS / name, args, daemon_env(daemon))


def run_script(
    name: str,
    *args: str,
    daemon: DaemonProc | None = None,
    expect_kill: bool = False,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<name>`` with ``args`` (see :func:`start_script`) and wait; a trainer that
    should die by SIGKILL may."""
    proc = start_script(name, *args, daemon=daemon).wait(timeout)
    if expect_kill:
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert "CHECKPOINT-SAVED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return proc


@pytest.fixture
def script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``script(name, *args, daemon=..., expect_kill=...)``: run a trainer script."""
    return run_script
