"""Copies between nodes (a backup push, a peer fetch) that move only what the receiving node
does not hold already.

Between two checkpoints much of a state is often unchanged (a frozen base under LoRA,
experts that saw no tokens), and the receiving node often still holds the previous copy. So
a push's offer (:attr:`~ckptcache.wire.peer.PushRequest.digests`) or a fetched copy's head
(:attr:`~ckptcache.wire.peer.ObjectHead.digests`) may carry the copy's digest table. The
receiver looks among the generations it holds for storages of the same size and digest
(:func:`find_held`), copies those from its own memory into the new segment, and answers which
ones it has (:attr:`~ckptcache.wire.peer.Ack.have`). The sender then sends every byte of the
body outside those storages (:func:`gaps`: the other storages and the archive's metadata), in
order (:func:`batches`), then the digest table, on the same connection.

Why no stale or foreign byte can be committed this way:

* **Every storage is checked against the table before the commit**, as for a full push: one
  copied here is hashed where it landed (:func:`place`), and one received is hashed as its
  records are authenticated. A source that changed, a wrong match or a sender whose table
  differs from its offer fails the transfer and nothing is committed (a push is then sent
  again whole). A source found changed here is this node's fault, not the sender's
  (:class:`HeldCorrupt`): it is dropped from memory, and a fetch is then taken again whole.
* **Sources are the user's own.** Only generations of the same namespace saved by the same
  user (uid) are looked at, so a crafted digest collision can only copy that user's own bytes.
* **A source cannot go while it is read.** Each source generation is pinned from the match to
  the end of the fill; one retired meanwhile keeps its segment until then. Only the sources
  used are pinned (a pin copies back the pages a source shares with a newer save).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptcache.errors import CkptCacheError, CorruptCheckpoint
from ckptcache.format.digest import digest_bytes, digest_hex
from ckptcache.format.fastcopy import copy_runs
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import Manifest, StorageRecord
from ckptcache.wire.states import Tier

if TYPE_CHECKING:
    from ckptcache.server.memory.index import Generation
    from ckptcache.server.state import CacheState

__all__ = [
    "GATHER",
    "MIN_SHARE",
    "MIN_STORAGE",
    "SOURCES",
    "Held",
    "HeldCorrupt",
    "Within",
    "batches",
    "find_held",
    "gaps",
    "place",
]

#: Storages smaller than this are always sent: a match saves less than it costs to find.
MIN_STORAGE = 64 << 10
#: Held bytes below this share of the body: the whole body is sent (striped, as usual).
MIN_SHARE = 0.25
#: Generations looked at for matches, newest first.
SOURCES = 8
#: Ranges shorter than this travel gathered with their neighbours, one record per
#: ``GATHER`` bytes: between two held storages often lie only the archive's few bytes of
#: metadata, and a record per such range would cost more than its bytes.
GATHER = 1 << 20


class HeldCorrupt(CorruptCheckpoint):
    """A storage copied from this node's own generation failed its digest where it landed:
    that generation was dropped here; the copy's sender is not at fault."""


@dataclass(eq=False)
class Held:
    """Storages of an offered copy that this node holds: (storage index, source generation,
    offset of the same bytes in the source's segment), by index; the sources stay pinned
    until :meth:`release`."""

    state: CacheState
    picks: list[tuple[int, Generation, int]]
    pinned: list[Generation] = field(default_factory=list)

    @property
    def have(self) -> tuple[int, ...]:
        """The indices of the storages held, increasing."""
        return tuple(i for i, _, _ in self.picks)

    def release(self) -> None:
        """Unpin the sources."""
        with self.state.lock.held():
            for gen in self.pinned:
                self.state.unpin_locked(gen)
        self.pinned = []

    @contextlib.contextmanager
    def pinned_until_done(self) -> Iterator[Held]:
        """The sources stay pinned inside the block."""
        try:
            yield self
        finally:
            self.release()


def _uid(gen: Generation, fallback: int) -> int:
    return gen.saver.uid if gen.saver is not None else fallback


def find_held(
    state: CacheState,
    namespace: str,
    uid: int,
    manifest: Manifest,
    digests: Sequence[int],
    body: int,
) -> Held | None:
    """The storages of an offered copy (``manifest``, its ``digests``, a body of ``body``
    bytes) that this node holds in a generation of ``namespace`` saved by ``uid`` (``-1``:
    the daemon's own), pinned; ``None`` when they are too few to be worth it
    (:data:`MIN_SHARE`)."""
    storages = manifest.storages
    if len(digests) != len(storages):
        return None
    daemon_uid = state.arena.uid
    want = daemon_uid if uid < 0 else uid
    with state.lock.held():
        candidates = sorted(
            (g for g in state.index
             if g.namespace == namespace and g.digests is not None and not g.corrupt
             and not g.removed and _uid(g, daemon_uid) == want),
            key=lambda g: -g.committed_ns,
        )[:SOURCES]  # fmt: skip
    # Matched by their digests alone (a generation's manifest and digests never change);
    # only the sources a match uses are read, so only those are pinned.
    picks = _match(candidates, storages, digests)
    if sum(storages[i].nbytes for i, _, _ in picks) < MIN_SHARE * body:
        return None
    used = list({id(g): g for _, g, _ in picks}.values())
    for gen in used:  # pages in a newer save's memory: copied back without the lock
        with contextlib.suppress(CkptCacheError):
            state.make_whole(gen)
    sources = []
    with state.lock.held():
        for gen in used:
            try:
                state.pin_locked(gen)
            except CkptCacheError:  # gone, or its pages could not be read back
                continue
            sources.append(gen)
    held = Held(state, [p for p in picks if any(p[1] is g for g in sources)], sources)
    if sum(storages[i].nbytes for i, _, _ in held.picks) < MIN_SHARE * body:
        held.release()
        return None
    return held


def _match(
    sources: list[Generation], storages: Sequence[StorageRecord], digests: Sequence[int]
) -> list[tuple[int, Generation, int]]:
    """Each storage of the offered copy that ``sources`` hold: (index, source, offset)."""
    where: dict[tuple[int, int], tuple[Generation, int]] = {}
    for gen in reversed(sources):  # the newest source of a content wins
        assert gen.digests is not None
        for record, digest in zip(gen.manifest.storages, gen.digests, strict=True):
            if record.nbytes >= MIN_STORAGE:
                where[(record.nbytes, digest)] = (gen, record.offset)
    picks = []
    for i, (record, digest) in enumerate(zip(storages, digests, strict=True)):
        hit = where.get((record.nbytes, digest)) if record.nbytes >= MIN_STORAGE else None
        if hit is not None:
            picks.append((i, *hit))
    return picks


def gaps(manifest: Manifest, body: int, have: Sequence[int]) -> list[tuple[int, int]]:
    """The ranges of the body (offsets from the end of the segment header) outside the
    storages ``have``, in order: what a push sends when the receiver holds those. Raises
    ``ValueError`` for an index out of range or a storage outside the body."""
    storages = manifest.storages
    spans = []
    for i in have:
        if not 0 <= i < len(storages):
            raise ValueError(f"storage index {i} out of range (the copy has {len(storages)})")
        lo = storages[i].offset - HEADER_SIZE
        hi = lo + storages[i].nbytes
        if lo < 0 or hi > body:
            raise ValueError(f"storage {i} lies outside the body of {body} bytes")
        spans.append((lo, hi))
    out: list[tuple[int, int]] = []
    pos = 0
    for lo, hi in sorted(spans):
        if lo > pos:
            out.append((pos, lo))
        pos = max(pos, hi)
    if pos < body:
        out.append((pos, body))
    return out


class Within:
    """The storages of ``manifest`` that lie wholly inside a range of its body, found by
    bisection (a copy of 50,000 tensors is cut into as many ranges)."""

    def __init__(self, manifest: Manifest):
        self._spans = sorted(
            (s.offset - HEADER_SIZE, i, s.nbytes) for i, s in enumerate(manifest.storages)
        )
        self._starts = [start for start, _, _ in self._spans]

    def __call__(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(storage index, start, end) of each storage wholly inside ``[lo, hi)`` (a storage
        of no bytes counts where it starts before ``hi``)."""
        out = []
        for start, i, nbytes in self._spans[bisect.bisect_left(self._starts, lo) :]:
            if start >= hi:
                break
            if start + nbytes <= hi:
                out.append((i, start, start + nbytes))
        return out


def batches(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``spans`` (from :func:`gaps`) as they travel: a range of :data:`GATHER` bytes or more
    alone, shorter neighbours together up to about that much (both ends cut the same way)."""
    out: list[list[tuple[int, int]]] = []
    run: list[tuple[int, int]] = []
    size = 0
    for lo, hi in spans:
        if hi - lo >= GATHER:
            if run:
                out.append(run)
                run, size = [], 0
            out.append([(lo, hi)])
            continue
        run.append((lo, hi))
        size += hi - lo
        if size >= GATHER:
            out.append(run)
            run, size = [], 0
    if run:
        out.append(run)
    return out


def place(view: memoryview, held: Held, manifest: Manifest, digests: Sequence[int]) -> None:
    """Copy the held storages into ``view`` (the new segment from the end of its header on)
    and check each where it landed against ``digests``; raises :class:`CorruptCheckpoint`.

    One copy call for them all (streaming stores, the interpreter lock released); the sources'
    mappings are exported only for its length (a pinned source is never remapped)."""
    storages = manifest.storages
    for i, source, offset in held.picks:  # raw addresses below: every run checked first
        start, n = storages[i].offset - HEADER_SIZE, storages[i].nbytes
        inside = 0 <= start <= len(view) - n and 0 <= offset <= len(source.segment.mapping) - n
        if not inside:
            raise ValueError(f"storage {i} of {manifest.path!r} lies outside its segment")
    dst = ctypes.c_char.from_buffer(view)
    sources = {id(g): ctypes.c_char.from_buffer(g.segment.mapping) for g in held.pinned}
    try:
        base = ctypes.addressof(dst) - HEADER_SIZE  # view starts at the end of the header
        copy_runs([(base + storages[i].offset, ctypes.addressof(sources[id(g)]) + offset,
                    storages[i].nbytes) for i, g, offset in held.picks])  # fmt: skip
    finally:
        del dst, sources
    for i, source, _offset in held.picks:
        record = storages[i]
        lo = record.offset - HEADER_SIZE
        got = digest_bytes(view[lo : lo + record.nbytes])
        if got != digests[i]:
            found = f"has digest {digest_hex(got)}, expected {digest_hex(digests[i])}"
            with held.state.lock.held():
                held.state.drop_corrupt_locked(source, f"tensor {record.name!r} {found} (read "
                                               f"for a copy of {manifest.path!r})")  # fmt: skip
            raise HeldCorrupt(
                f"copy of {manifest.path!r}: tensor {record.name!r} taken from this node's "
                f"generation {source.number} of {source.path!r} {found}",
                tensor=record.name, tier=Tier.LOCAL,
            )  # fmt: skip
