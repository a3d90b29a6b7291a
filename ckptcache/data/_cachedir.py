"""The data cache's default directory: one no other local user can create first.

``/dev/shm`` is writable by everyone, so a fixed name there (``/dev/shm/ckptcache-data-<uid>``)
can be created by another user before the victim's first run: the loader refuses it
(correctly: batches there could be forged) and the job stops at start. The default is
therefore, in this order:

1. ``$XDG_RUNTIME_DIR/ckptcache-data`` when that directory is this user's and private (systemd's
   ``/run/user/<uid>``, a tmpfs nobody else can create entries in);
2. the directory recorded for this host in ``$XDG_STATE_HOME/ckptcache/data-cache-dir-<host>``
   (``~/.local/state`` by default), when it still exists and is this user's;
3. ``/dev/shm/ckptcache-data-<uid>``, when it is free (created now) or already this user's;
4. otherwise (someone else holds that name) a fresh unpredictable name,
   ``/dev/shm/ckptcache-data-<uid>-<random>``, recorded as in 2 so that the restarted run (and
   every other rank of the job on this node) finds it again.

A recorded directory that is gone (the node rebooted) is never created again under its old
name (it could be read from a listing of ``/dev/shm`` meanwhile): a new one is chosen and
recorded. Ranks resolve the name under a lock in the record's directory, so all agree. A
planted directory is never used: steps 2 and 3 accept only this user's own, private ones,
and :class:`~ckptcache.data._store.BatchDir` checks again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import socket
import stat
from collections.abc import Iterator

from ckptcache.errors import ConfigError

__all__ = ["default_cache_dir"]

_SHM = "/dev/shm"


def _mine(path: str, forbidden: int) -> bool:
    """Whether ``path`` is a directory (not a link) of this user with none of the mode bits
    ``forbidden`` set."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & forbidden


def _private_dir(path: str) -> bool:
    """Whether ``path`` is a directory (not a link) of this user that nobody else may enter."""
    return _mine(path, stat.S_IRWXG | stat.S_IRWXO)


def _own_dir(path: str) -> bool:
    """Whether ``path`` is a directory of this user that only this user may write to."""
    return _mine(path, stat.S_IWGRP | stat.S_IWOTH)


def _runtime_dir() -> str | None:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and _private_dir(runtime):
        return os.path.join(runtime, "ckptcache-data")
    return None


def _state_dir() -> str | None:
    """This user's private ``$XDG_STATE_HOME/ckptcache`` (created), or None where there is
    no home to keep it in."""
    home = os.path.expanduser("~")
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state")
    if not os.path.isabs(base):
        return None
    path = os.path.join(base, "ckptcache")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path if _private_dir(path) else None


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(record: str) -> str | None:
    try:
        with open(record, encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _claim_fixed(path: str) -> bool:
    """Create ``path`` (0700) or accept it if it is already this user's own."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    return _own_dir(path)


def _fresh(uid: int) -> str:
    while True:
        path = os.path.join(_SHM, f"ckptcache-data-{uid}-{secrets.token_hex(8)}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return path


def default_cache_dir() -> str:
    """The directory batches live in unless ``cache_dir`` is given (see the module docstring)."""
    runtime = _runtime_dir()
    if runtime is not None:
        return runtime
    uid = os.getuid()
    fixed = os.path.join(_SHM, f"ckptcache-data-{uid}")
    state = _state_dir()
    if state is None:
        if _claim_fixed(fixed):
            return fixed
        raise ConfigError(
            f"the data cache's default directory {fixed} belongs to somebody else, and there "
            "is no private home directory to record another name in: pass cache_dir, or set "
            "XDG_RUNTIME_DIR or XDG_STATE_HOME to a directory of your own"
        )
    record = os.path.join(state, f"data-cache-dir-{socket.gethostname()}")
    with _locked(record + ".lock"):
        recorded = _read(record)
        if recorded is not None and _own_dir(recorded):
            return recorded
        if _claim_fixed(fixed):
            return fixed
        chosen = _fresh(uid)
        tmp = f"{record}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(chosen + "\n")
        os.replace(tmp, record)
        return chosen
