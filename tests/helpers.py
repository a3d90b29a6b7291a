"""Test helpers: real daemon processes with their own sockets and shared-memory roots."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ckptcache
from ckptcache.cli.benchmarking import EtcdServer, free_port, wait_for_socket  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


@dataclass
class DaemonProc:
    """A daemon subprocess standing in for one node."""

    workdir: Path
    shm_dir: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    #: Command prefix, e.g. ``["prlimit", "--nofile=256:256", "--"]``.
    wrapper: list[str] = field(default_factory=list)
    #: Run with the daemon's own defaults (no ``--memory-only allow`` added).
    defaults: bool = False

    @property
    def socket(self) -> str:
        return str(self.workdir / "daemon.sock")

    @property
    def segments_dir(self) -> str:
        return os.path.join(self.shm_dir, "segments")

    @property
    def log_path(self) -> Path:
        return self.workdir / "daemon.log"

    def start(self) -> DaemonProc:
        cmd = [*self.wrapper, sys.executable, "-m", "ckptcache.cli", "daemon",
               "--socket", self.socket, "--shm-dir", self.shm_dir, *self.daemon_args()]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, **self.env})
        log.close()
        wait_for_socket(self.socket, self.proc)
        return self

    def daemon_args(self) -> list[str]:
        """The arguments given, plus ``--memory-only allow`` unless the test chose
        (``--memory-only``) or names no choice at all (``defaults=True``): most tests save
        under temporary paths they never mean to persist."""
        if self.defaults or "--memory-only" in self.args:
            return list(self.args)
        return [*self.args, "--memory-only", "allow"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        if self.proc is not None and self.proc.poll() is not None:
            # A daemon under libfaketime (skewed-clock tests) leaves its shared-memory
            # counters behind when it does not exit normally.
            for name in (f"faketime_shm_{self.proc.pid}", f"sem.faketime_sem_{self.proc.pid}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))

    def restart(self) -> DaemonProc:
        self.kill()
        return self.start()

    def client(self, **kwargs: Any) -> ckptcache.Client:
        return ckptcache.Client(self.socket, **kwargs)

    def status(self) -> Any:
        """Daemon-wide status through a short-lived client."""
        with self.client() as c:
            return c.daemon_status()

    def info(self, path: Any) -> Any:
        """Status of one path through a short-lived client."""
        with self.client() as c:
            return c.status(path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def segment_bytes(self) -> int:
        """Bytes of the segment files now (one the daemon unlinks meanwhile, a spare given up
        for a save, counts as gone)."""
        d = self.segments_dir
        if not os.path.isdir(d):
            return 0
        total = 0
        for name in os.listdir(d):
            if name.startswith("."):  # the daemon's records of its segments, not segments
                continue
            try:
                total += os.path.getsize(os.path.join(d, name))
            except FileNotFoundError:
                continue
        return total

    def cleanup(self) -> None:
        """SIGTERM, escalated to SIGKILL (with a warning) if the daemon is still up after 30 s:
        a hung shutdown must not turn into an error in an unrelated test's teardown."""
        try:
            self.kill(signal.SIGTERM)
        except subprocess.TimeoutExpired:
            warnings.warn(f"daemon {self.workdir.name} ignored SIGTERM for 30 s", stacklevel=2)
            self.kill()
        if os.path.isdir(self.shm_dir):
            from ckptcache.server.memory.sealing import unseal_tree

            unseal_tree(self.shm_dir)  # admitted users' segments are sealed (chattr +a)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def new_daemon(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, defaults: bool = False
) -> DaemonProc:
    """A daemon (not started) with a unique shm root under /dev/shm (``defaults``: see
    :meth:`DaemonProc.daemon_args`)."""
    workdir = tmp_path / f"node-{uuid.uuid4().hex[:6]}"
    workdir.mkdir()
    shm = f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:10]}"
    return DaemonProc(workdir, shm, list(args), env or {}, defaults=defaults)


def assert_same(a: Any, b: Any, *, exact: bool = False) -> None:
    """Deep equality with tensor dtype, shape, stride-insensitive values and type checks;
    ``exact`` also compares each tensor's strides, storage offset and ``requires_grad``, and
    the attributes of a dict (an ``OrderedDict``'s ``_metadata``)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        if exact:
            geometry = (a.stride(), a.storage_offset(), a.requires_grad)
            assert geometry == (b.stride(), b.storage_offset(), b.requires_grad)
        if a.dtype.is_floating_point and a.element_size() == 1:  # fp8: compare bits
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:
            assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        if exact and hasattr(a, "__dict__"):
            assert vars(a) == vars(b)
        for k in a:
            assert_same(a[k], b[k], exact=exact)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=False):
            assert_same(x, y, exact=exact)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert_same(vars(a), vars(b))
    else:
        import numpy as np

        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b) and a.dtype == b.dtype
        else:
            assert a == b


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[None]:
    """Make ``path`` refuse new files, for root too (immutable attribute; chmod otherwise)."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o500)
        try:
            yield
        finally:
            path.chmod(0o700)


def thread_inside(thread: threading.Thread, function: str, **local_values: Any) -> bool:
    """Whether ``thread`` is now running (or blocked) inside a call of ``function``.

    ``local_values`` narrow it to calls whose locals have these values, e.g. ``kind="reserve"``.
    Lets a test wait until another thread has reached a blocking point instead of sleeping.
    """
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function and all(
            frame.f_locals.get(k) == v for k, v in local_values.items()
        ):
            return True
        frame = frame.f_back
    return False


def wait_until(
    predicate: Callable[[], Any], timeout: float = 30.0, what: str = "", interval: float = 0.05
) -> Any:
    """Poll ``predicate()`` until it returns something truthy, and return that.

    A bounded safety net for waiting on state, never a timing assertion. Exceptions raised by
    ``predicate`` count as "not yet" (the daemon may still be starting); the last one is shown
    if the wait times out.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:
            last = e
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"timed out after {timeout}s waiting for {what or predicate} (last error: {last!r})"
            )
        time.sleep(interval)


def run_on_terminal(
    cmd: list[str], stream: str, env: dict[str, str] | None = None, timeout: float = 600
) -> tuple[int, str, str]:
    """Run ``cmd`` with ``stream`` (``"stdout"`` or ``"stderr"``) on a pseudo-terminal and the
    other on a pipe, as a command run in a terminal and piped on one side sees them: returns
    (exit code, what reached the terminal, what reached the pipe). The terminal's text has
    its line ends as the terminal makes them (``\\r\\n``)."""
    import pty

    other = "stderr" if stream == "stdout" else "stdout"
    master, slave = pty.openpty()
    try:
        pipes: dict[str, Any] = {stream: slave, other: subprocess.PIPE}
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, **pipes)
    finally:
        os.close(slave)
    chunks: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        out, err = proc.communicate(timeout=timeout)
        reader.join(timeout)
    finally:
        os.close(master)
    piped = err if other == "stderr" else out
    return proc.returncode, b"".join(chunks).decode(errors="replace"), piped.decode()


def metric(daemon: Any, series: str) -> float | None:
    """One series of a daemon started with ``--metrics-port`` (``name`` or
    ``name{label="value"}``), read from its metrics endpoint; ``None`` where it has none."""
    import urllib.request

    wait_until(lambda: "metrics=:" in daemon.log(), 30, "the daemon's ready line")
    port = int(daemon.log().split("metrics=:")[-1].split()[0])  # a restart's ready line
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(f"{series} "):
            return float(line.split()[1])
    return None
