"""The loading rank's lease: who loads a batch directory, and whether that process still lives.

The lease file holds the owner's pid, its start time (so a recycled pid is not mistaken for
the owner) and its pid namespace (so a reader in another container does not probe an unrelated
process with the same number). A heartbeat thread touches the file; its mtime is the heartbeat.

The lease says who loads; the lock decides it. Reading and writing the lease cannot stop two
processes from both finding no live owner and both writing theirs, so the loading rank also
holds an exclusive ``flock`` on a lock file for its lifetime: the second one is refused, and the
kernel drops the lock when the holder dies, however it dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import dataclass

from ckptcache._atomic import atomic_write

__all__ = [
    "HEARTBEAT_S",
    "STALE_AFTER_S",
    "Heartbeat",
    "Lease",
    "lock_exclusive",
    "pid_alive",
    "read_lease",
    "unlock",
]

#: How often the loading rank touches its lease.
HEARTBEAT_S = 1.0
#: A lease not touched for this long belongs to a frozen (or unreachable) process.
STALE_AFTER_S = 15.0


def _start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot); ``None`` if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return int(stat.rsplit(b")", 1)[1].split()[19])


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists in our pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Lease:
    """A decoded lease file."""

    pid: int
    start_time: int
    pid_namespace: int
    host: str
    #: mtime of the lease file: the last heartbeat.
    heartbeat: float

    @classmethod
    def mine(cls) -> Lease:
        """The lease this process would write."""
        pid = os.getpid()
        return cls(pid, _start_time(pid) or 0, _pid_namespace(), socket.gethostname(), 0.0)

    @property
    def ident(self) -> tuple[int, int]:
        """(pid, start time): unique for a process over the life of the node."""
        return (self.pid, self.start_time)

    def checkable(self) -> bool:
        """Whether this process can probe the owner's pid (same node and pid namespace)."""
        return self.host == socket.gethostname() and self.pid_namespace == _pid_namespace()

    def owner_alive(self) -> bool:
        """False only when the owner is known to be dead (or its heartbeat is stale)."""
        if time.time() - self.heartbeat > STALE_AFTER_S:
            return False
        if not self.checkable():
            return True  # only the heartbeat can tell
        return _start_time(self.pid) == self.start_time

    def describe(self) -> str:
        """``pid 1234 on host`` for messages."""
        return f"pid {self.pid} on {self.host}"

    def write(self, path: str) -> None:
        """Publish atomically (temp file + rename)."""
        tmp = f"{path}.{self.pid}.tmp"
        record = {
            "pid": self.pid, "start_time": self.start_time,
            "pid_namespace": self.pid_namespace, "host": self.host,
        }  # fmt: skip
        atomic_write(path, lambda f: f.write(json.dumps(record).encode()), tmp=tmp, fsync=False)


def read_lease(path: str) -> Lease | None:
    """The lease at ``path``, or ``None`` if there is none (or it is half-written garbage)."""
    try:
        with open(path) as f:
            raw = json.load(f)
            mtime = os.fstat(f.fileno()).st_mtime
        return Lease(
            int(raw["pid"]), int(raw["start_time"]), int(raw["pid_namespace"]),
            str(raw["host"]), mtime,
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


#: Lock files this process holds. A forked child (a ``DataLoader`` worker) closes its copies at
#: once: the lock must go with the loading rank, not with the last of its orphaned workers
#: (a restarted loading rank would be refused until they noticed). ``O_CLOEXEC`` covers exec.
_held: set[int] = set()


def _close_in_child() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def lock_exclusive(path: str) -> int | None:
    """Take a non-blocking exclusive ``flock`` on ``path`` (created 0600, never a link).

    Returns the descriptor to keep open while holding the lock, or ``None`` if another open
    file holds it (another process, or another loader of this one).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    _held.add(fd)
    return fd


def unlock(fd: int) -> None:
    """Release a lock taken by :func:`lock_exclusive`."""
    _held.discard(fd)
    os.close(fd)


class Heartbeat:
    """A daemon thread that touches ``path`` every :data:`HEARTBEAT_S` seconds until stopped."""

    def __init__(self, path: str):
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptcache-data-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return  # the directory was removed (close or reclaim): nothing to keep alive

    def stop(self) -> None:
        """Stop touching the lease (it then goes stale)."""
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S)
