"""Parallel ranged reads that keep the landed prefix of an object moving.

A group's storage read is relayed as it lands, and relays can only follow the *contiguous*
prefix of landed bytes. Two things hold that prefix back:

* TCP flows that share a link are unfair over seconds. With every range handed to the next
  free thread, one slow request holds the prefix while the others race ahead, and the relay
  then has all they landed to catch up on. Here no range starts more than ``lead`` ranges
  past the first one that has not landed: once the others are that far ahead they wait, and
  the slow request has the link to itself.
* Ranges in flight together land together. The last ``workers`` ranges of a read would all
  finish at its very end, and the relay start on the last ``workers x chunk`` bytes only
  then. :func:`plan_ranges` tapers the ranges towards the end (halving down to one block),
  so the tail the relay waits for is a few blocks.
* Ranges in flight together share the link, so the first one, which the prefix waits for,
  lands about when the ones after it do. Reads report their progress inside a range
  (``progress``; S3's every :data:`~ckptcache.storage.s3.READ_PIECE` bytes), and the prefix
  follows the first range as it lands instead of jumping once it has all landed.

How many ranges at once is itself a trade. Where one connection fills the reader's link, a
second range only halves the rate of the one the prefix waits for, and the relays trail by
what the second one landed ahead; where the store serves each connection at a fraction of the
link (real object stores), one range at a time reads the object several times slower.
:func:`probe_streams` tells the two apart at the start of the read, on a few small ranges.

Call order: optionally :func:`probe_streams` over the object's first bytes, then
:func:`plan_ranges` over the rest, then :meth:`PrefixReads.run` once (it returns when every
range has landed, or raises the first read's error once the other workers stopped).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["PROBE", "PrefixReads", "more_streams", "plan_ranges", "probe_streams"]

#: ``read_into(offset, view, progress)``: fill ``view`` with the object's bytes from
#: ``offset``, calling ``progress(n)`` as the first ``n`` bytes of ``view`` are in place (at
#: least once, at the end: :func:`ckptcache.storage.reporting.read_into_reporting`).
ReadInto = Callable[[int, memoryview, Callable[[int], None]], None]


def _ignore(index: int, n: int) -> None:
    """Progress within a range that nobody follows."""


#: The range of one stream in a probe round. Where a second stream shares the link, the relays
#: trail by at most this for the rest of the read; large enough that a round is not all
#: request latency on a real object store (``docs/restore.md`` has the figures).
PROBE = 2 << 20


def more_streams(before: float, now: float, streams: int) -> bool:
    """Whether ``streams`` ranged reads at once, together at ``now`` bytes/s, beat one fewer
    at ``before``: the added stream brought at least half of one stream's share. Where the
    link is the bound, ``now`` stays at ``before`` (the streams split it); where each
    connection is, it grows by ``before / (streams - 1)``."""
    return now >= before * (1 + 0.5 / (streams - 1))


def probe_streams(
    read: Callable[[int, int], None],
    size: int,
    most: int,
    *,
    latency: float = 0.0,
    block: int = PROBE,
) -> tuple[int, list[tuple[int, int]]]:
    """Choose how many ranged reads at once (1 to ``most``) suit a store and link by reading
    the object's first bytes in rounds: round ``k`` reads the next ``k`` ranges of ``block``
    bytes at once, ``read(offset, n)`` each (in file order: the relays' prefix keeps moving),
    and is kept while :func:`more_streams` says its rate beat the round before. Probing
    stops at the first round that does not, at ``most``, or before the probe would pass
    half the object (a small object is read on the streams chosen so far, at least one).

    ``latency`` (seconds: a small request's round trip, measured beforehand) is taken off
    each round's time, so that a store's time to the first byte, which parallel requests
    overlap whatever bounds the bytes, does not pass for its rate (at most 7/8 of a round:
    a latency measured a little long must not leave a round no time). Returns the count and
    the ranges read, ``(offset, length)`` from offset 0.
    """
    streams, rate, off = 1, 0.0, 0
    done: list[tuple[int, int]] = []
    for k in range(1, max(1, most) + 1):
        if off + k * block > size // 2:
            break
        batch = [(off + i * block, block) for i in range(k)]
        t0 = time.monotonic()
        if k == 1:
            read(*batch[0])
        else:
            with ThreadPoolExecutor(k, thread_name_prefix="storage-probe") as pool:
                for future in [pool.submit(read, o, n) for o, n in batch]:
                    future.result()
        elapsed = time.monotonic() - t0
        now = k * block / max(elapsed - latency, elapsed / 8, 1e-9)
        done += batch
        off += k * block
        if k > 1 and not more_streams(rate, now, k):
            break
        streams, rate = k, now
    return streams, done


def plan_ranges(size: int, chunk: int, workers: int, block: int) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges covering ``size`` bytes: ``chunk`` bytes each while more
    than ``workers`` such ranges are left, then halved each time the rest fits in ``workers``
    ranges, down to ``block``. Every offset is a multiple of ``block`` (``chunk`` is one)."""
    ranges: list[tuple[int, int]] = []
    off = 0
    while off < size:
        while chunk > block and size - off <= workers * chunk:
            chunk = max(block, chunk // 2 // block * block)
        n = min(chunk, size - off)
        ranges.append((off, n))
        off += n
    return ranges


class PrefixReads:
    """Read ``ranges`` (``(offset, length)``, in file order) into ``view`` on ``workers``
    threads, at most ``lead`` ranges past the first that has not landed; ``landed(index)``
    runs once per range, after its bytes are in place (from the worker that read it), and
    ``progress(index, n)`` each time the read of range ``index`` reports its first ``n`` bytes
    in place, before that (so the prefix a relay follows moves inside a range)."""

    def __init__(
        self,
        read_into: ReadInto,
        view: memoryview,
        ranges: list[tuple[int, int]],
        *,
        workers: int,
        lead: int,
        landed: Callable[[int], None],
        progress: Callable[[int, int], None] = _ignore,
    ):
        self.read_into = read_into
        self.view = view
        self.ranges = ranges
        self.workers = max(1, min(workers, len(ranges)))
        self.lead = max(1, lead)
        self.landed = landed
        self.progress = progress
        self._cond = threading.Condition()
        self._next = 0  # the first range not requested
        self._first = 0  # the first range not landed
        self._done = [False] * len(ranges)
        self._error: BaseException | None = None

    def run(self) -> None:
        """Read every range; raises the first error a read or ``landed`` raised."""
        if not self.ranges:
            return
        with ThreadPoolExecutor(self.workers, thread_name_prefix="storage-read") as pool:
            for future in [pool.submit(self._work) for _ in range(self.workers)]:
                future.result()  # workers keep their errors in _error: this only waits
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        while (index := self._take()) is not None:
            off, n = self.ranges[index]
            try:
                progress = functools.partial(self.progress, index)
                self.read_into(off, self.view[off : off + n], progress)
                self.landed(index)
            except BaseException as e:
                with self._cond:
                    self._error = self._error or e
                    self._cond.notify_all()
                return
            with self._cond:
                self._done[index] = True
                while self._first < len(self.ranges) and self._done[self._first]:
                    self._first += 1
                self._cond.notify_all()

    def _take(self) -> int | None:
        """The next range to read, once it is within the lead; None when none is left (or a
        read failed: the others stop at their next range)."""
        with self._cond:
            while self._error is None and self._next < len(self.ranges):
                if self._next < self._first + self.lead:
                    index, self._next = self._next, self._next + 1
                    return index
                self._cond.wait()
            return None
