"""The digests of an object's storages, taken as its records land.

A received record is tagged and hashed in one pass
(:class:`~ckptcache.server.cluster.dataplane.RecordHasher`); this says which bytes of each
record belong to which storage, and keeps each storage's digest once the record that
completes it has checked. One object arrives as one body, or as stripes of it on parallel
connections: a window of the body is hashed the same way, for the storages that lie wholly
inside it (a storage a cut splits is hashed once every stripe is in).
"""

from __future__ import annotations

from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import Manifest
from ckptcache.server.cluster.dataplane import Span, Xxh3

__all__ = ["LandingDigests"]


class LandingDigests:
    """The digests of the storages of ``manifest`` that lie wholly in the body window
    ``[lo, hi)`` (the whole body by default), kept in ``out`` by storage index (a fresh list
    of zeros by default). Records arrive in order, so each storage's bytes are planned once,
    in order."""

    def __init__(
        self, manifest: Manifest, lo: int = 0, hi: int | None = None, out: list[int] | None = None
    ):
        storages = manifest.storages
        end = hi if hi is not None else float("inf")
        order = sorted(range(len(storages)), key=lambda i: storages[i].offset)
        self.spans_of = [(i, start - lo, start - lo + storages[i].nbytes)
                         for i in order
                         for start in (storages[i].offset - HEADER_SIZE,)
                         if lo <= start < end and start + storages[i].nbytes <= end]  # fmt: skip
        self.digests: list[int] = out if out is not None else [0] * len(storages)
        self.planned = 0  # index into spans_of of the first storage not yet fully planned
        self.next = 0  # index into spans_of of the first storage without its digest
        self.state = Xxh3()

    def spans(self, start: int, end: int) -> list[Span]:
        """What to hash of the window's bytes ``[start, end)`` (relative to ``start``)."""
        out: list[Span] = []
        while self.planned < len(self.spans_of):
            _i, lo, hi = self.spans_of[self.planned]
            if lo >= end and not (lo == hi == end):
                break
            a, b = max(lo, start), min(hi, end)
            ends = hi <= end
            if b > a or ends:
                out.append((max(a - start, 0), max(b - start, 0), ends))
            if not ends:
                break
            self.planned += 1
        return out

    def hashed(self, digests: list[int]) -> None:
        """Digests of the storages completed by the record just authenticated, in order."""
        for digest in digests:
            self.digests[self.spans_of[self.next][0]] = digest
            self.next += 1

    @property
    def complete(self) -> bool:
        """Whether every storage of the window has its digest."""
        return self.next == len(self.spans_of)
