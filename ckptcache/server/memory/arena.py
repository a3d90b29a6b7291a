"""The arena: segment files in shared memory, a free pool for reuse, and the memory budget.

Segment files are created with ``fallocate`` (pages allocated up front, so a full tmpfs fails
here with a clear error instead of SIGBUS in a trainer mid-copy) and are reused across
generations: a client that keeps its mapping of a reused segment writes at memcpy speed.

The arena never holds more than ``limit`` bytes of segment files. It is not thread-safe on its
own; the daemon core calls it under its lock.

Names are unique per daemon incarnation (``<incarnation>-<counter>``) so that a client's cached
mapping can never silently point at a different file that reused a name.

Segments of admitted users are those users' files: the daemon touches its mapping of one only
while it is sealed against truncation (:mod:`ckptcache.server.memory.sealing`), and never believes a
header it did not write itself (:attr:`Segment.read_header` returns the daemon's own copy).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from ckptcache._secure_fs import check_owned, ensure_private_dir
from ckptcache.errors import ConfigError, CorruptCheckpoint
from ckptcache.format.layout import (
    HEADER_SIZE,
    SEGMENT_GRANULE,
    DigestState,
    SegmentHeader,
    SegmentState,
    align,
)
from ckptcache.format.pagetables import POPULATE_IN_PARALLEL, populate_in_steps
from ckptcache.server.memory import records, sealing
from ckptcache.server.memory.sharing import Run, Sharing
from ckptcache.wire.states import Tier

__all__ = ["Arena", "Segment", "empty_header"]

#: An object under a MiB is given whole pages of this size (see Arena.capacity_for).
_PAGE = mmap.PAGESIZE

log = logging.getLogger(__name__)

#: Linux only; elsewhere a spare's pages are faulted by their first write instead.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def mapped_by_others(segment: Segment) -> bool:
    """Whether a process holds a load mapping of ``segment``: clients hold a shared ``flock``
    on the segment file for as long as a load mapping lives (``ckptcache.codec.shm.map_private``).

    A file swapped in under the segment's name (a symlink, a FIFO: an admitted user may write
    its own segment directory) counts as mapped, so the segment is never reused; the open
    neither follows nor blocks (it runs under the state lock)."""
    try:
        fd = segment.open_fd()
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("not reusing segment %s: %s", segment.name, e)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's own lock
    return False


@dataclass(eq=False)
class Segment:
    """One segment file and the daemon's own mapping of it."""

    name: str
    path: str
    capacity: int
    mapping: mmap.mmap
    #: Found on disk at startup: clients of an earlier incarnation may still map it, so it is
    #: unlinked rather than reused once free (unlinking never disturbs an existing mapping).
    inherited: bool = False
    last_used: float = field(default_factory=time.monotonic)
    #: The uid whose saves use this segment (the file is readable by that uid alone).
    owner: int = field(default_factory=os.geteuid)
    #: (st_dev, st_ino) of the file the daemon created or adopted: a later open by path
    #: must find this very file, not something swapped in under its name.
    identity: tuple[int, int] = (0, 0)
    #: Never used since it was pre-faulted for the spare pool (see ``server/memory/pool.py``).
    spare: bool = False
    #: The file belongs to an admitted user (not root, not the daemon): the daemon reads its
    #: mapping only while :attr:`sealed` (see :mod:`ckptcache.server.memory.sealing`).
    sealable: bool = False
    sealed: bool = False
    #: The header the daemon last wrote: what it believes, whatever the file says now.
    header: SegmentHeader | None = None
    #: The daemon's own record of what the segment holds (see
    #: :mod:`ckptcache.server.memory.records`).
    record_path: str | None = None
    #: Names the bytes a client's commit left in the segment (a random token, given to that
    #: client); 0 from the moment the segment is handed out again (a ``WRITING`` header) or
    #: cut. A client skips copying storages it provably did not write since into a segment
    #: handed out with its token (``ckptcache/client/_unchanged.py``). Kept in memory only:
    #: a restart forgets them all.
    content: int = 0
    #: :attr:`content` once the segment, freed, was found to hold exactly the bytes its
    #: generation's digests name (``Digester.check_free``): only then is the token handed out,
    #: so bytes changed in a free segment (a stray write, a flipped bit) are never kept.
    checked: int = 0
    #: The digests, by offset, of the storages the check found (with :attr:`checked`).
    checked_digests: dict[int, int] = field(default_factory=dict)
    #: The checked token the segment held when it was last handed out (0: none), and the
    #: digests that came with it.
    handed: int = 0
    handed_digests: dict[int, int] = field(default_factory=dict)
    #: The daemon reading this free segment in the background, or copying a newer
    #: generation's bytes into it first (``None``: neither); whatever hands the segment out
    #: or unlinks it stops the copy first, and it is never cut meanwhile.
    fill: Fill | None = None
    #: Where this committed segment's pages lie in other segments (see
    #: :mod:`ckptcache.server.memory.sharing`): those pages are holes here.
    runs: list[Run] = field(default_factory=list)
    #: Ranges of the file that are holes (the runs', or a freed segment's not allocated yet).
    holes: list[tuple[int, int]] = field(default_factory=list)
    #: Bytes of :attr:`holes` not counted in the budget (those of a committed segment's runs).
    hollow: int = 0
    #: The segments whose runs lie in this one: it is freed only after them.
    dependents: set[Segment] = field(default_factory=set, repr=False)
    #: Its generation left memory, but it still backs :attr:`dependents` (or is read by the
    #: sharer: :attr:`readers`).
    orphan: bool = False
    #: The sharer, or a copy back into another segment, reads this segment now, without the
    #: lock: it is neither freed nor hollowed meanwhile.
    readers: int = 0
    #: Copies of its runs' bytes back into it in flight (``Sharing.begin_whole``).
    copying: int = 0

    def stop_fill(self) -> None:
        """Stop the daemon's copy into this segment, if one runs, and wait until it has
        (the daemon may still hash it: a reading that a change of bytes makes fail)."""
        fill = self.fill
        if fill is not None:
            fill.stop()

    def open_fd(self) -> int:
        """Open the segment file read-only, refusing a symlink or a file swapped in under its
        name (the directory of an admitted user's segments is writable by that user)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            raise OSError(errno.ESTALE, f"segment file {self.path} was replaced")
        return fd

    @contextlib.contextmanager
    def opened(self) -> Iterator[int]:
        """:meth:`open_fd`, closed on exit."""
        fd = self.open_fd()
        try:
            yield fd
        finally:
            os.close(fd)

    def read_header(self) -> SegmentHeader:
        """The header the daemon last wrote (decoded from the mapping only at adoption): the
        page is writable by the segment's clients, so it is never read back."""
        if self.header is None:
            self.header = SegmentHeader.unpack(memoryview(self.mapping)[:HEADER_SIZE])
        return self.header

    def write_header(self, header: SegmentHeader) -> None:
        """Write the header; the state field lands last in one store of the packed struct.

        The daemon's record follows: written after the page when committed (a commit is
        acknowledged only once both are), dropped before it otherwise (a crash between the
        two never brings a freed generation back)."""
        packed = header.pack()
        committed = header.state == SegmentState.COMMITTED
        if header.state == SegmentState.WRITING:  # handed out: its bytes change from now on
            self.handed = self.content if self.checked == self.content else 0
            self.handed_digests = self.checked_digests if self.handed else {}
            self.content = self.checked = 0
            self.checked_digests = {}
        if not committed:
            records.drop(self)
        self.mapping[: len(packed)] = packed
        self.header = header
        if committed:
            records.write(self, 0, packed)

    def seal(self) -> int:
        """Seal an admitted user's segment (see :func:`ckptcache.server.memory.sealing.seal`);
        returns the size the file had once sealed (below :attr:`capacity`: it was cut)."""
        flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(self.path, flags)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.identity:
                raise OSError(errno.ESTALE, f"segment file {self.path} was replaced")
            size = sealing.seal(fd, self.capacity)
        finally:
            os.close(fd)
        self.sealed = True
        return size

    def unseal(self) -> None:
        """Let the owner open the segment for writing again (a save of its own)."""
        with self.opened() as fd:
            sealing.set_sealed(fd, False)
        self.sealed = False

    def view(self) -> memoryview:
        """A memoryview of the whole segment (zero copy), once the file is found whole
        (:meth:`check_whole`)."""
        self.check_whole()
        return memoryview(self.mapping)

    def check_whole(self) -> None:
        """Raise :class:`CorruptCheckpoint` where the segment's file is shorter than the
        daemon's mapping of it, or was replaced: a read of the mapping past the file's end
        is a SIGBUS, which ends the daemon and takes every checkpoint it holds offline. (A
        file of the daemon's own can be cut by its user or root only; an admitted user's is
        sealed.) One ``stat``."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise CorruptCheckpoint(
                f"segment file {self.path} is gone ({e.strerror}): its bytes are not read",
                tier=Tier.LOCAL,
            ) from e
        if st.st_size < len(self.mapping) or (
            self.identity != (0, 0) and (st.st_dev, st.st_ino) != self.identity
        ):
            raise CorruptCheckpoint(
                f"segment file {self.path} was cut to {st.st_size} of {len(self.mapping)} "
                "bytes or replaced behind the daemon: its bytes are not read",
                tier=Tier.LOCAL,
            )


class Fill:
    """The daemon's background work on a free segment (``Digester``): a copy into it, a
    chunk at a time, then a hash of it. A caller that needs the segment (a reservation, an
    unlink; under the state lock) stops the copy, and waits at most for the chunk in
    progress, since the copy takes no lock of the daemon's."""

    def __init__(self) -> None:
        #: Set by :meth:`stop`; the copy checks it before each chunk.
        self.stopped = False
        self._done = threading.Event()

    def stop(self) -> None:
        """Ask the copy to stop, and wait until it has."""
        self.stopped = True
        self._done.wait()

    def finish(self) -> None:
        """The copy has stopped writing the segment (called by the copy, last; at once where
        there is nothing to copy)."""
        self._done.set()


_Rank = tuple[bool, bool, int, bool, bool, float]


def _preference(mapped: Collection[str], known: Collection[int]) -> Callable[[Segment], _Rank]:
    """The order :meth:`Arena.take_free` prefers free segments in (smallest first)."""
    return lambda s: (
        s.name not in mapped, s.spare and not s.checked, s.capacity, s.checked not in known,
        not s.checked, -s.last_used,
    )  # fmt: skip


def empty_header(state: SegmentState) -> SegmentHeader:
    """The header of a segment that holds no object (``FREE``, or ``WRITING`` for a new one)."""
    return SegmentHeader(
        state=state, generation=0, payload_offset=HEADER_SIZE, payload_size=0,
        manifest_offset=0, manifest_size=0, digest_offset=0, n_storages=0,
        digest_state=DigestState.PENDING, created_ns=time.time_ns(), committed_ns=0,
    )  # fmt: skip


class Arena:
    """Segment files under ``directory`` within a budget of ``limit`` bytes."""

    def __init__(self, directory: str, limit: int, mode: int = 0o700):
        self.directory = directory
        self.limit = limit
        self.incarnation = f"{int(time.time()):x}{os.getpid():x}"
        self._counter = 0
        self.segments: dict[str, Segment] = {}
        self.free: dict[str, Segment] = {}
        #: Bytes of segment files being created outside the lock (the spare pool's growth):
        #: counted as used so the budget holds while they are allocated.
        self.pending = 0
        self.uid = os.geteuid()
        os.close(ensure_private_dir(directory, mode, "segments dir"))
        #: The daemon's records of committed segments (0700, ours: see server/memory/records.py).
        self.records_dir = os.path.join(directory, ".records")
        os.close(ensure_private_dir(self.records_dir, 0o700, "records dir"))
        #: Pages of older generations read from newer ones' segments.
        self.sharing = Sharing(self)

    def _record_path(self, name: str) -> str:
        return os.path.join(self.records_dir, os.path.basename(name))

    def untrusted(self, owner: int) -> bool:
        """Whether segments of ``owner`` are files another user can write (sealed)."""
        return owner not in (0, self.uid)

    def _owner_dir(self, owner: int) -> str:
        """Relative directory of ``owner``'s segments: ours at the top, others' in ``u<uid>``."""
        return "" if owner in (0, self.uid) else f"u{owner}"

    def _ensure_owner_dir(self, owner: int) -> str:
        """Create (or check) the 0700 directory owned by ``owner`` that holds its segments.

        It lies in our own directory, so its name cannot be swapped; its content belongs to
        ``owner`` and is never trusted beyond that user's own objects.
        """
        sub = self._owner_dir(owner)
        if not sub:
            return sub
        path = os.path.join(self.directory, sub)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid == self.uid and owner != self.uid:
                os.fchown(fd, owner, -1)  # just created by us
            elif st.st_uid != owner:
                raise ConfigError(f"refusing {path}: owned by uid {st.st_uid}, not {owner}")
        finally:
            os.close(fd)
        return sub

    @property
    def used(self) -> int:
        """Bytes of all segment files (in use, reserved and free), pages another segment
        holds for them not counted."""
        return self.pending + sum(s.capacity - s.hollow for s in self.segments.values())

    @property
    def orphaned(self) -> int:
        """Bytes of segments kept only for the pages others read from them."""
        return sum(s.capacity - s.hollow for s in self.segments.values() if s.orphan)

    @property
    def free_bytes(self) -> int:
        """Bytes held by the free pool (reclaimable at once)."""
        return sum(s.capacity for s in self.free.values())

    @staticmethod
    def capacity_for(nbytes: int) -> int:
        """Capacity of a new segment for ``nbytes``: rounded up so near sizes share segments
        (to a whole MiB); an object under a MiB to whole pages only, so that it costs the
        budget about its size (a DCP or Megatron rank writes many small files: ``.metadata``,
        ``common.pt``; 1,000 saves of 4 KiB held 1,000 MiB at a MiB each)."""
        nbytes = max(nbytes, HEADER_SIZE)
        return align(nbytes, SEGMENT_GRANULE if nbytes >= SEGMENT_GRANULE else _PAGE)

    def take_free(
        self,
        nbytes: int,
        *,
        tight: bool,
        owner: int | None = None,
        mapped: Collection[str] = (),
        known: Collection[int] = (),
    ) -> Segment | None:
        """Best-fit free segment of ``owner`` (default: ours) for ``nbytes``.

        ``mapped``: the segments the saving client maps already; one of them comes first
        (any other costs the client a first mapping inside its save, page tables of the
        whole segment). Then segments that some client maps (freed generations) before
        spares, which stay for new segments; a spare checked to hold a save's bytes counts
        as a freed generation's. Then the best fit (a larger segment taken for a small save
        could leave no room for a large one), and among equals first one checked to hold a
        save the client knows (its token is one of ``known``, the tokens its commits were
        given: the save copies only what changed since), then the segments checked to hold
        any save's bytes, the most recently freed first: the daemon copied the newest save
        into them (``refill``). Unless ``tight`` (no room to create a new one), a segment
        more than twice too big is left alone: it would waste memory that a later large save
        needs. A segment is never handed to another user: its last user may still map it.
        """
        owner = self.uid if owner is None else owner
        largest = self.limit if tight else 2 * self.capacity_for(nbytes)
        fits = [
            s
            for s in self.free.values()
            if nbytes <= s.capacity <= largest
            and self._owner_dir(s.owner) == self._owner_dir(owner)
            and not s.holes  # pages given back to the system: allocated by its refill first
        ]
        while fits:
            best = min(fits, key=_preference(mapped, known))
            if not mapped_by_others(best):
                break
            # A load mapping outlived its pin (its connection dropped): its zero-copy tensors
            # still read this segment, so it is not reused until the mapping goes.
            fits.remove(best)
        if not fits:
            return None
        # ``best.spare`` is left for the caller: the pool notes a spare taken (SegmentPool.claim).
        best.stop_fill()
        del self.free[best.name]
        best.write_header(empty_header(SegmentState.WRITING))
        best.last_used = time.monotonic()
        return best

    def create(self, nbytes: int, owner: tuple[int, int] | None = None) -> Segment:
        """Create, allocate and map a new segment; raises ``OSError`` if tmpfs is full.

        ``owner`` (uid, gid) of another user: the file lies in that user's directory and
        belongs to that user (mode 0600), so no other unprivileged user can read it.
        """
        uid, gid = owner if owner is not None else (self.uid, -1)
        segment = self.allocate(self.next_name(uid), self.capacity_for(nbytes), uid, gid)
        self.segments[segment.name] = segment
        return segment

    def next_name(self, uid: int) -> str:
        """A fresh segment name in ``uid``'s directory (call under the caller's lock)."""
        self._counter += 1
        return os.path.join(
            self._ensure_owner_dir(uid), f"seg-{self.incarnation}-{self._counter:06d}"
        )

    def allocate(
        self, name: str, capacity: int, uid: int, gid: int = -1, *, populate: bool = False
    ) -> Segment:
        """Create and allocate the file ``name`` without registering it: safe outside the
        lock (the pool grows this way), provided ``name`` came from :meth:`next_name`.

        ``populate``: fill the daemon's page tables for the whole mapping now (the pool's
        spares, made in the background), so a receive writing through it takes no faults.
        """
        path = os.path.join(self.directory, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        sealable = self.untrusted(uid)
        try:
            if self._owner_dir(uid):
                os.fchown(fd, uid, gid)
            os.posix_fallocate(fd, 0, capacity)
            # A step at a time where the kernel can: MAP_POPULATE would hold the daemon's
            # address-space lock for the whole spare, and every request thread's mmap and
            # munmap (a reserve, a load, the interpreter's own arenas) behind it.
            steps = populate and POPULATE_IN_PARALLEL
            flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate and not steps else 0)
            # Mapped before the seal: a sealed file refuses new writable mappings.
            mapping = mmap.mmap(fd, capacity, flags=flags)
            if steps:
                populate_in_steps(mapping)
            if sealable:
                sealing.seal(fd, capacity)
            st = os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                sealing.set_sealed(fd, False)
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        segment = Segment(name, path, capacity, mapping, owner=uid)
        segment.sealable = segment.sealed = sealable
        segment.identity = (st.st_dev, st.st_ino)
        segment.record_path = self._record_path(name)
        segment.write_header(empty_header(SegmentState.WRITING))
        return segment

    def trim(self, segment: Segment, capacity: int) -> None:
        """Shrink a free, never-mapped-for-reading segment to ``capacity`` bytes in place.

        The allocated pages below ``capacity`` stay (still pre-faulted); the tail goes back
        to the system. A client mapping longer than the file only loses the tail's pages.
        Best effort: a segment the daemon reads in the background stays whole (a read past
        the cut would be a SIGBUS).
        """
        segment.stop_fill()
        if segment.fill is not None or segment.holes:
            return
        fd = os.open(segment.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != segment.identity:
                raise OSError(errno.ESTALE, f"segment file {segment.path} was replaced")
            segment.content = segment.checked = 0
            segment.checked_digests = {}
            os.ftruncate(fd, capacity)
            try:
                segment.mapping.close()
            except BufferError:
                pass
            segment.mapping = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        segment.capacity = capacity

    def release(self, segment: Segment) -> None:
        """Return a segment to the free pool (or unlink it if inherited from a crash); one that
        backs another segment's pages stays until that one goes (``Sharing.needed``)."""
        if self.sharing.needed(segment):
            segment.write_header(empty_header(SegmentState.FREE))
            return
        if segment.runs:
            # Its header first: a crash after its runs' record went must not leave a committed
            # generation with holes and no record of where they lie.
            segment.write_header(empty_header(SegmentState.FREE))
            self.sharing.release(segment)
            # Its holes are allocated again only by a refill, for a client that watches its
            # storages (its content token); and only where there is room.
            if self.used > self.limit or not segment.content:
                self.destroy(segment)
                return
        if segment.inherited:
            self.destroy(segment)
            return
        if segment.sealable and not segment.sealed:
            try:
                segment.seal()  # its user wrote it until now: nothing is read before this
            except OSError as e:
                log.warning("dropping segment %s: cannot seal it (%s)", segment.name, e)
                self.destroy(segment)
                return
        segment.write_header(empty_header(SegmentState.FREE))
        segment.last_used = time.monotonic()
        self.free[segment.name] = segment

    def destroy(self, segment: Segment) -> None:
        """Unlink a segment and forget it (one backing another's pages stays, an orphan)."""
        if self.sharing.needed(segment):
            log.info("keeping segment %s: it holds pages of %d others", segment.name,
                     len(segment.dependents))  # fmt: skip
            segment.write_header(empty_header(SegmentState.FREE))
            return
        segment.stop_fill()
        self.segments.pop(segment.name, None)
        self.free.pop(segment.name, None)
        records.drop(segment)
        try:
            segment.mapping.close()
        except BufferError:
            # A memoryview still exports it (a persist in flight); the GC closes it later.
            pass
        if segment.sealable:
            with contextlib.suppress(OSError), segment.opened() as fd:
                sealing.set_sealed(fd, False)  # a sealed file cannot be unlinked
        try:
            os.unlink(segment.path)
        except FileNotFoundError:
            pass
        self.sharing.forget(segment)  # after the unlink: a crash never leaves holes unrecorded

    def shrink_free(self, needed: int) -> None:
        """Unlink free segments, least recently used first, until ``needed`` bytes fit."""
        for segment in sorted(self.free.values(), key=lambda s: s.last_used):
            if self.used + needed <= self.limit:
                return
            self.destroy(segment)

    def scan(self) -> Iterator[tuple[Segment, SegmentHeader | None]]:
        """Adopt the segment files left by an earlier incarnation.

        Yields each with its header (``None`` if unreadable); the caller keeps committed ones
        and gives the rest to :meth:`release` or :meth:`destroy`. A file in our own directory
        that is not ours (or a symlink) stops the start: someone planted it. In an admitted
        user's directory, files that are not that user's are removed, never opened.
        """
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            st = os.lstat(path)
            if name.startswith("u") and name[1:].isdigit() and stat.S_ISDIR(st.st_mode):
                if st.st_uid != int(name[1:]):
                    raise ConfigError(f"refusing {path}: owned by uid {st.st_uid}, not {name[1:]}")
                yield from self._scan_user(name, int(name[1:]))
                continue
            if not name.startswith("seg-"):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"refusing segment {path}: not a regular file (a symlink?)")
            check_owned(path, st, {self.uid}, "segment")
            adopted = self._adopt(name, path, self.uid)
            if adopted is not None:
                yield adopted
        # Records of segments that are gone (destroyed by a crash's predecessor, or unlinked).
        kept = {os.path.basename(name) for name in self.segments}
        for name in os.listdir(self.records_dir):
            if name not in kept:
                os.unlink(os.path.join(self.records_dir, name))

    def _scan_user(self, sub: str, uid: int) -> Iterator[tuple[Segment, SegmentHeader | None]]:
        for entry in sorted(os.listdir(os.path.join(self.directory, sub))):
            name = os.path.join(sub, entry)
            path = os.path.join(self.directory, name)
            st = os.lstat(path)
            if not entry.startswith("seg-") or not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                log.error("removing %s: not a segment file of uid %d", path, uid)
                os.unlink(path)
                continue
            adopted = self._adopt(name, path, uid)
            if adopted is not None:
                yield adopted

    def _adopt(
        self, name: str, path: str, owner: int
    ) -> tuple[Segment, SegmentHeader | None] | None:
        sealable = self.untrusted(owner)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
                log.error("removing %s: replaced while being adopted", path)
                os.unlink(path)
                return None
            if sealable:  # sealed by the last incarnation: reopened writable below
                sealing.set_sealed(fd, False)
            if st.st_size == 0:
                # Created, never allocated: the daemon stopped between the two (not damage).
                log.info("removing empty segment %s left by an allocation cut short", name)
                os.unlink(path)
                return None
            if st.st_size < HEADER_SIZE:
                log.error("removing segment %s: truncated to %d bytes", name, st.st_size)
                os.unlink(path)
                return None
            # The same inode, writable (its path could have been swapped meanwhile).
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                mapping = mmap.mmap(rw, st.st_size, flags=mmap.MAP_SHARED)
                # Sealed again before the mapping is read; a cut made while the seal was
                # off is restored with zeros and counts as damage.
                if sealable and sealing.seal(rw, st.st_size) < st.st_size:
                    log.error("removing segment %s: truncated while being adopted", name)
                    mapping.close()
                    sealing.set_sealed(rw, False)
                    os.unlink(path)
                    return None
            finally:
                os.close(rw)
        finally:
            os.close(fd)
        segment = Segment(name, path, st.st_size, mapping, inherited=True, owner=owner)
        segment.sealable = segment.sealed = sealable
        segment.identity = (st.st_dev, st.st_ino)
        segment.record_path = self._record_path(name)
        self.segments[name] = segment
        try:
            header: SegmentHeader | None = segment.read_header()
        except ValueError as e:
            if any(segment.mapping[:HEADER_SIZE]):
                log.error("segment %s has an unreadable header (%s)", name, e)
            else:  # allocated, never written: the daemon stopped in between (not damage)
                log.info("reclaiming segment %s: allocated but never written", name)
            header = None
        return segment, header
