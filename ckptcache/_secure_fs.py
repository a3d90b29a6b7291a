"""Owner and mode checks for the directories and files the daemon and its clients trust.

``/dev/shm`` and ``/tmp`` are writable by every local user, so a name there may have been
planted before the daemon started: a directory owned by someone else, a symlink to a file the
daemon would then open as root, a forged segment. Everything here works on ``lstat`` and
``O_NOFOLLOW`` opens and compares what it opened with what it checked, so a symlink or a
swapped entry is refused rather than followed.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection

from ckptcache.errors import ConfigError

__all__ = [
    "check_ancestors",
    "check_owned",
    "current_umask",
    "ensure_private_dir",
    "foreign_control",
    "open_private_file",
]

#: Bits that let somebody other than the owner change a directory or file.
_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH


def foreign_control(st: os.stat_result, owners: Collection[int]) -> str | None:
    """What lets a user outside ``owners`` change the directory or file ``st`` describes, said
    as the end of a sentence about it (``"is owned by uid 1001"``, ``"is writable by other users
    (mode 0777)"``), or ``None`` when nothing does. The one test every trust check here and in
    the clients applies; each caller words the refusal and the remedy for its reader."""
    if st.st_uid not in owners:
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & _FOREIGN_WRITE:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_owned(path: str, st: os.stat_result, owners: set[int], what: str) -> None:
    """Raise :class:`ConfigError` unless ``st`` is owned by one of ``owners`` and writable by
    its owner alone."""
    problem = foreign_control(st, owners)
    if problem is not None:
        want = " or ".join(f"uid {u}" for u in sorted(owners))
        raise ConfigError(
            f"refusing {what} {path}: it {problem} (trusted: {want}); somebody else may have "
            "planted it or may change it. Remove it, chmod go-w it or choose another path"
        )


def check_ancestors(path: str, owners: set[int]) -> None:
    """Every existing ancestor of ``path`` must be a directory that only ``owners`` (or root)
    can rename entries in: owned by them and not group/other-writable, or sticky (``/tmp``)."""
    allowed = owners | {0}
    head = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            st = os.lstat(head)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISLNK(st.st_mode):
                # A symlinked ancestor (/var/run -> /run) is fine when root or we own the link
                # and its target passes the same test.
                if st.st_uid not in allowed:
                    raise ConfigError(
                        f"refusing {path}: its ancestor {head} is a symlink of uid {st.st_uid}"
                    )
                check_ancestors(os.path.join(os.path.realpath(head), "x"), owners)
                return
            sticky = bool(st.st_mode & stat.S_ISVTX)
            if st.st_uid not in allowed or (st.st_mode & _FOREIGN_WRITE and not sticky):
                raise ConfigError(
                    f"refusing {path}: its ancestor {head} (uid {st.st_uid}, mode "
                    f"{stat.S_IMODE(st.st_mode):04o}) lets other users replace entries in it"
                )
        parent = os.path.dirname(head)
        if parent == head:
            return
        head = parent


def ensure_private_dir(path: str, mode: int, what: str, *, owners: set[int] | None = None) -> int:
    """Create ``path`` (mode ``mode``) or accept an existing one owned by us; return an
    ``O_DIRECTORY | O_NOFOLLOW`` fd of it.

    An existing directory must be a real directory (not a symlink), owned by this process's
    uid (or ``owners``), and not writable by group or others; its mode is then set to
    ``mode``. Anything else raises :class:`ConfigError` naming the path and the reason.
    """
    me = os.geteuid()
    owners = owners or {me}
    path = os.path.abspath(path)
    check_ancestors(path, owners)
    # Missing ancestors are created private; existing ones were checked just above.
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create {what} {path}: {e.strerror}") from e
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"refusing {what} {path}: it is a symlink; remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"refusing {what} {path}: it is not a directory")
    check_owned(path, st, owners, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"refusing {what} {path}: {e.strerror}") from e
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise ConfigError(f"refusing {what} {path}: it was replaced while being checked")
    if stat.S_IMODE(opened.st_mode) != mode and opened.st_uid == me:
        os.fchmod(fd, mode)
    return fd


def open_private_file(dir_fd: int, name: str, flags: int, what: str, mode: int = 0o600) -> int:
    """Open (or create) ``name`` in the trusted directory ``dir_fd`` without following a
    symlink, and check it is a regular file of ours that no one else can write."""
    try:
        fd = os.open(
            name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd
        )
    except OSError as e:
        reason = "it is a symlink" if e.errno == errno.ELOOP else e.strerror
        raise ConfigError(f"refusing {what} {name}: {reason}") from e
    st = os.fstat(fd)
    try:
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"refusing {what} {name}: not a regular file")
        check_owned(name, st, {os.geteuid()}, what)
    except ConfigError:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def current_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would race threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
