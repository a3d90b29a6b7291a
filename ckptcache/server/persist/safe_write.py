"""Persisting under a storage root without ever leaving it.

Roots are checked when a save arrives, but the file is written later: a directory under the
root replaced by a symlink in between would carry a root daemon's write anywhere. Here the
path is resolved at write time from an fd of the root, one component at a time with
``O_NOFOLLOW | O_DIRECTORY``, and the temporary file is created, renamed and synced relative to
the fd of its final directory, so no symlink is ever followed below the root.

The file and the directories created get the owner and mode a ``torch.save`` by the saver
would have given them, and a root daemon only writes where the saver itself could.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable

from ckptcache.errors import PathNotAllowed
from ckptcache.server.ownership import Saver, daemon_saver, groups_of
from ckptcache.server.persist.incremental import RecordReuse
from ckptcache.server.persist.lineage import DirectoryRemoved, removed_reason
from ckptcache.server.persist.object_reuse import ObjectReuse
from ckptcache.server.persist.roots import PersistRoots
from ckptcache.storage.base import Producer, StorageBackend, WriteGuard
from ckptcache.storage.fs import (
    TEMP_MARK,
    FileBackend,
    check_guard,
    direct_stream_fill,
    link_unnamed,
    open_unnamed,
)
from ckptcache.storage.ranges import GappedProducer, copy_pays, gapped_stream_fill
from ckptcache.storage.s3 import S3Backend

__all__ = ["persist_write", "write_beneath"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Walker:
    """Carries the saver's identity and the root through one write."""

    def __init__(self, root: str, path: str, saver: Saver, anchor: str = ""):
        self.root, self.path, self.saver, self.anchor = root, path, saver, anchor
        self.as_root = os.geteuid() == 0
        # A root daemon acting for another user checks that user's permissions itself.
        self.check_access = self.as_root and saver.uid != 0
        self.groups = groups_of(saver.uid, saver.gid) if self.check_access else set()

    def require(self, fd: int, want: int, where: str) -> None:
        """Refuse unless the saver has ``want`` (rwx bits, 0-7) on the directory ``fd``."""
        if not self.check_access:
            return
        st = os.fstat(fd)
        if st.st_uid == self.saver.uid:
            bits = st.st_mode >> 6
        elif st.st_gid in self.groups:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        if bits & want != want:
            raise PathNotAllowed(
                f"cannot persist {self.path!r}: uid {self.saver.uid} may not write under "
                f"{where} (mode {stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid})"
            )

    def may_replace(self, dir_fd: int, name: str) -> bool:
        """Whether the saver may replace or remove entry ``name`` of directory ``dir_fd``: in a
        sticky directory (a shared scratch space) only the entry's owner or the directory's
        may, whatever the write bits say."""
        if not self.check_access:
            return True
        st = os.fstat(dir_fd)
        if not st.st_mode & stat.S_ISVTX or st.st_uid == self.saver.uid:
            return True
        try:
            entry = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        return entry.st_uid == self.saver.uid

    def require_replace(self, dir_fd: int, name: str) -> None:
        """Refuse unless :meth:`may_replace`."""
        if not self.may_replace(dir_fd, name):
            raise PathNotAllowed(
                f"cannot persist {self.path!r}: it belongs to another user and its directory "
                f"is sticky; uid {self.saver.uid} may not replace it"
            )

    def adopt(self, fd: int, mode: int) -> None:
        """Give a directory or file we just created the saver's owner and mode."""
        st = os.fstat(fd)
        inherit_gid = bool(st.st_mode & stat.S_ISGID) and stat.S_ISDIR(st.st_mode)
        if self.as_root:
            os.fchown(fd, self.saver.uid, -1 if inherit_gid else self.saver.gid)
        os.fchmod(fd, mode | (stat.S_ISGID if inherit_gid else 0))

    def existed_at_save(self, where: str) -> bool:
        """Whether directory ``where`` existed when the checkpoint was saved (it is the save's
        anchor or one of its ancestors)."""
        a = self.anchor
        return bool(a) and (a == where or a.startswith(where.rstrip("/") + "/"))

    def step(self, parent: int, name: str, where: str) -> int:
        """Open (creating if needed) directory ``name`` of ``parent`` without following it."""
        for _ in range(2):
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PathNotAllowed(
                        f"cannot persist {self.path!r}: {where} is a symlink or not a "
                        f"directory; refusing to follow it out of the storage root {self.root!r}"
                    ) from e
                raise
            if self.existed_at_save(where):
                # The user removed it since: recreating it would resurrect a deleted checkpoint.
                raise DirectoryRemoved(removed_reason(self.anchor))
            self.require(parent, 0o3, os.path.dirname(where) or self.root)
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                continue  # created meanwhile: open whatever is there now, without following
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            self.adopt(fd, self.saver.dir_mode)
            return fd
        raise PathNotAllowed(f"cannot persist {self.path!r}: {where} keeps changing")


def _file_gid_inherited(dir_fd: int) -> bool:
    return bool(os.fstat(dir_fd).st_mode & stat.S_ISGID)


def write_beneath(
    root: str,
    path: str,
    fill: Callable[[int], None],
    saver: Saver,
    *,
    guard: WriteGuard | None = None,
    anchor: str = "",
    create_root: bool = True,
    previous: Callable[[int | None], None] | None = None,
) -> None:
    """Atomically write ``path`` (lexically under ``root``) with ``fill(fd)``: temp file,
    fsync, rename and directory fsync, all relative to directory fds below ``root``.

    ``anchor`` is the deepest directory that existed at save time: directories below it are
    created, and it or an ancestor gone raises :class:`DirectoryRemoved`. With a ``guard``
    the file's mtime is its stamp, and the file already there is replaced only if the guard
    allows it (checked before the bytes move and again right before the rename).

    ``previous``, if given, is called before ``fill`` with a read-only fd of the file now at
    ``path`` (opened without following a link; None when there is none), which stays open
    until ``fill`` returns: the fill may copy from it."""
    rel = os.path.relpath(path, root)
    parts = rel.split("/")
    if rel.startswith("..") or any(p in ("", ".", "..") for p in parts):
        raise PathNotAllowed(f"cannot persist {path!r}: not below the storage root {root!r}")
    walker = _Walker(root, path, saver, anchor)
    if create_root:  # configured by the administrator: create it as the daemon if missing
        os.makedirs(root, exist_ok=True)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        if create_root:
            raise
        raise DirectoryRemoved(removed_reason(anchor or root)) from e
    try:
        where = root
        for part in parts[:-1]:
            walker.require(fd, 0o1, where)
            where = os.path.join(where, part)
            child = walker.step(fd, part, where)
            os.close(fd)
            fd = child
        walker.require(fd, 0o3, where)
        if previous is None:
            _write_in(fd, parts[-1], fill, walker, guard)
        else:
            source = _open_previous(fd, parts[-1])
            try:
                previous(source)
                _write_in(fd, parts[-1], fill, walker, guard)
            finally:
                if source is not None:
                    os.close(source)
    finally:
        os.close(fd)


def _open_previous(dir_fd: int, name: str) -> int | None:
    """A read-only fd of the regular file ``name`` of ``dir_fd`` (never through a link),
    None where there is none or it cannot be opened (the persist then writes everything)."""
    try:
        return os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return None


def _link_new(fd: int, name: str, dir_fd: int) -> bool:
    """Name the unnamed file ``fd`` straight as ``name`` if nothing is there yet (no temporary
    name shows, so a concurrent ``rmtree`` never meets one); False if ``name`` exists."""
    try:
        link_unnamed(fd, name, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def _write_in(
    dir_fd: int, name: str, fill: Callable[[int], None], walker: _Walker, guard: WriteGuard | None
) -> None:
    walker.require_replace(dir_fd, name)
    check_guard(name, guard, dir_fd=dir_fd)
    leftover = f".{name}{TEMP_MARK}"
    for entry in os.listdir(dir_fd):
        if entry.startswith(leftover) and walker.may_replace(dir_fd, entry):
            try:
                os.unlink(entry, dir_fd=dir_fd)
            except OSError:
                pass
    tmp = f"{leftover}{secrets.token_hex(4)}"
    fd = open_unnamed(".", dir_fd=dir_fd, mode=0o600)
    named = fd is None
    if fd is None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        try:
            if walker.as_root:
                gid = -1 if _file_gid_inherited(dir_fd) else walker.saver.gid
                os.fchown(fd, walker.saver.uid, gid)
            os.fchmod(fd, walker.saver.file_mode)
            fill(fd)
            if guard is not None:
                os.utime(fd, ns=(guard.stamp_ns, guard.stamp_ns))
            os.fsync(fd)
            if not named:  # unnamed until complete
                if _link_new(fd, name, dir_fd):
                    os.fsync(dir_fd)  # a new file: named once, complete, no temp name ever
                    return
                link_unnamed(fd, tmp, dir_fd=dir_fd)  # replacing a file: named for the rename
                named = True
        finally:
            os.close(fd)
        check_guard(name, guard, dir_fd=dir_fd)  # again right before the rename
        walker.require_replace(dir_fd, name)  # another user's file may have landed meanwhile
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        if named:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        raise
    os.fsync(dir_fd)


def persist_write(
    roots: PersistRoots,
    backend: StorageBackend,
    target: str,
    produce: Producer,
    saver: Saver | None,
    *,
    guard: WriteGuard | None = None,
    anchor: str = "",
    reuse: RecordReuse | ObjectReuse | None = None,
    produce_gapped: GappedProducer | None = None,
) -> None:
    """Write one object to storage: local files through :func:`write_beneath` (resolved
    below their root at write time), everything else through its backend.

    With ``reuse`` and ``produce_gapped``, what the object now at the path holds and
    ``reuse`` proves equal is copied from it: records of a local file
    (:mod:`ckptcache.server.persist.incremental`), ranges of an S3 object
    (:mod:`ckptcache.server.persist.object_reuse`); the object written is the same."""
    if not isinstance(backend, FileBackend):
        backend.cleanup(target)
        if isinstance(reuse, ObjectReuse) and produce_gapped is not None:
            assert isinstance(backend, S3Backend)
            if reuse.prepare(backend.version(target)):
                backend.write_spliced(
                    target, produce_gapped, reuse.copies, token=reuse.token, guard=guard
                )
                return
        backend.write_stream(target, produce, guard=guard)
        return
    assert not isinstance(reuse, ObjectReuse)
    root = roots.local_root(target)
    if root is None:
        raise PathNotAllowed(f"cannot persist {target!r}: it is under no storage root")
    fill = direct_stream_fill(produce)  # O_DIRECT where the file system takes it
    previous = None
    if reuse is not None and produce_gapped is not None:
        plain = fill

        def fill(fd: int) -> None:
            if reuse.source is None or not copy_pays(reuse.source, fd):
                plain(fd)  # nothing to copy from, or a copy that costs more: the plain persist
                return
            gapped_stream_fill(produce_gapped, reuse.finish)(fd)

        previous = reuse.attach
    if roots.implicit:
        # A daemon running as the user writes wherever the user could: symlinks the user
        # made above the save's directory are followed (not refused as leaving a root), and
        # only the directories missing at save time are created below it.
        root, target, anchor = _below_anchor(target, anchor)
    write_beneath(root, target, fill, saver or daemon_saver(), guard=guard, anchor=anchor,
                  create_root=not roots.implicit, previous=previous)  # fmt: skip


def _below_anchor(target: str, anchor: str) -> tuple[str, str, str]:
    """``(root, target, anchor)`` rebased on the resolved directory the save found."""
    if not anchor or not os.path.isdir(anchor):
        raise DirectoryRemoved(removed_reason(anchor or os.path.dirname(target)))
    real = os.path.realpath(anchor)
    return real, os.path.join(real, os.path.relpath(target, anchor)), real
