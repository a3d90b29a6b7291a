"""Parallel ranged reads that keep the landed prefix of an object moving.

A group's storage read is relayed as it lands, and relays can only follow the *contiguous*
prefix of landed bytes. Two things held that prefix back, measured in the cluster lab (4
ranges at once on a 100 Mbit/s link, relayed to a chain of nodes):

* TCP flows that share a link are unfair over seconds. With every range handed to the next
  free thread, one slow request held the prefix while the others raced ahead: single ranges
  took 3-4 s where their neighbours took 1 s, and the relay then had 26 MiB to catch up on.
  Here no range starts more than ``lead`` ranges past the first one that has not landed: once
  the others are that far ahead they wait, and the slow request has the link to itself.
* Ranges in flight together land together. The last ``workers`` ranges of a read all
  finished at its very end, so the relay started on the last ``workers x chunk`` bytes only
  then. :func:`plan_ranges` tapers the ranges towards the end (halving down to one block),
  so the tail the relay waits for is a few blocks.
* Ranges in flight together share the link, so the first one, which the prefix waits for,
  lands about when the ones after it do. Reads report their progress inside a range
  (``progress``; S3's every :data:`~ckptcache.storage.s3.READ_PIECE` bytes), and the prefix
  follows the first range as it lands instead of jumping once it has all landed.

Call order: :func:`plan_ranges`, then :meth:`PrefixReads.run` once (it returns when every
range has landed, or raises the first read's error once the other workers stopped).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["PrefixReads", "plan_ranges"]

#: ``read_into(offset, view, progress)``: fill ``view`` with the object's bytes from
#: ``offset``, calling ``progress(n)`` as the first ``n`` bytes of ``view`` are in place (at
#: least once, at the end: :func:`ckptcache.storage.reporting.read_into_reporting`).
ReadInto = Callable[[int, memoryview, Callable[[int], None]], None]


def _ignore(index: int, n: int) -> None:
    """Progress within a range that nobody follows."""


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
