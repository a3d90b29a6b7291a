"""Ranged reads in which a stalled first range is asked for again (a hedged request).

The group's storage read is relayed as it lands, and relays follow the contiguous prefix:
the first range that has not landed holds every hop. Ranges in flight together share a link,
and TCP flows sharing a shallow queue are unfair over seconds: in the cluster lab, the first
range of a read had 2 MiB after 0.76 s, then nothing for 1.8 s (a flow waiting out its
retransmission timer) while the ranges after it landed 16 MiB. Object stores answer tail
latency the same way: a request that is far slower than its neighbours is sent again.

Here the *first range not landed* is hedged when the ranges after it land ``stall_pieces``
pieces while it lands none: a new request for the bytes it has not yet put in place, on a
new connection, which takes the range over.

**Who writes.** Each range of the shared view is written by one attempt at a time: the one
holding the range's token. An attempt reads pieces from its own stream into its own bytes,
and puts each piece in place under the range's lock only while it holds the token; a hedge
takes the token before it sends its request, and the attempt it replaces is aborted (its
connection shut) and, should bytes still reach it, refused before they are written. A
stalled original therefore never writes into the view after the hedge has taken over, and
every byte reported in place stays as it was reported.

Call order: build one :class:`HedgedReads` per read, pass :meth:`HedgedReads.read_into` as
the ``read_into`` of :class:`~ckptcache.format.prefix_read.PrefixReads`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ckptcache.storage.reporting import RangeStream

__all__ = ["HedgedReads", "OpenRange"]

log = logging.getLogger(__name__)

#: ``open_range(offset, length)``: a ranged request of the object's bytes.
OpenRange = Callable[[int, int], RangeStream]


class _Superseded(Exception):
    """An attempt that no longer holds its range's token."""


class _Range:
    """One range's bytes in the shared view and the attempt that may write them."""

    def __init__(self, view: memoryview, progress: Callable[[int], None], pieces_now: int):
        self.view = view
        self.progress = progress  # the first ``n`` bytes are in place (whoever put them)
        self.filled = 0  # bytes in place from the range's start
        self.token = 0  # the attempt allowed to write
        self.streams: dict[int, RangeStream] = {}
        self.mark = pieces_now  # the read's piece count at this range's last progress
        self.hedges = 0
        self.done = threading.Event()
        self.error: BaseException | None = None
        #: Each attempt's token and the offset in the range its request started at.
        self.attempts: list[tuple[int, int]] = []


class HedgedReads:
    """Ranges read through ``open_range``, each piece put in place by the attempt holding the
    range's token; the lowest range in flight is hedged when it stalls (see the module).

    ``stall_pieces``: pieces the other ranges land, while the first one lands none, before
    it is hedged (it had its fair share of the link that many times over and took none),
    twice that before its second hedge; ``max_hedges``: hedges per range.
    """

    def __init__(
        self, open_range: OpenRange, *, piece: int, stall_pieces: int, max_hedges: int = 2
    ):
        self.open_range = open_range
        self.piece = piece
        self.stall_pieces = max(1, stall_pieces)
        self.max_hedges = max_hedges
        self._lock = threading.Lock()
        self._ranges: dict[int, _Range] = {}  # by offset: the ranges in flight
        self._pieces = 0  # pieces put in place by every range so far
        #: (offset in the object, attempt token, start in the range) of every hedge sent.
        self.hedged: list[tuple[int, int, int]] = []

    def read_into(self, offset: int, view: memoryview, progress: Callable[[int], None]) -> None:
        """Fill ``view`` with the object's bytes from ``offset`` (a
        :data:`~ckptcache.format.prefix_read.ReadInto`), calling ``progress(n)`` as its first
        ``n`` bytes are in place; returns once the range is whole, whichever attempt made it."""
        with self._lock:
            rng = _Range(view, progress, self._pieces)
            self._ranges[offset] = rng
            token = self._take(rng)
        try:
            self._spawn(offset, rng, token, 0)
            rng.done.wait()  # the original or a hedge finishes it
            if rng.error is not None:
                raise rng.error
        finally:
            with self._lock:
                self._ranges.pop(offset, None)
                streams = list(rng.streams.values())
            for stream in streams:  # a hedge still blocked on a stalled connection
                stream.abort()

    def _take(self, rng: _Range) -> int:
        """A new token for ``rng`` (call with the lock held); the attempts before it may no
        longer write, and their connections are shut."""
        rng.token += 1
        rng.attempts.append((rng.token, rng.filled))
        for stream in rng.streams.values():
            stream.abort()
        rng.streams.clear()
        return rng.token

    def _attempt(self, offset: int, rng: _Range, token: int, start: int) -> None:
        """Read ``rng`` from ``start`` as attempt ``token``, until it is whole or the attempt
        loses its token. Only the attempt holding the token records an error or the end."""
        stream: RangeStream | None = None
        try:
            stream = self.open_range(offset + start, len(rng.view) - start)
            with self._lock:
                if rng.token != token:
                    raise _Superseded
                rng.streams[token] = stream
            pos = start
            while pos < len(rng.view):
                chunk = stream.read(min(self.piece, len(rng.view) - pos))
                if not chunk:
                    raise OSError(f"range at {offset + start} ended early, at {offset + pos}")
                pos = self._put(rng, token, pos, chunk)
                rng.progress(pos)
            with self._lock:
                if rng.token == token:
                    rng.done.set()
        except _Superseded:
            pass  # the hedge that took the range over finishes it
        except BaseException as e:
            with self._lock:
                if rng.token == token:
                    rng.error = e
                    rng.done.set()
        finally:
            if stream is not None:
                stream.close()
                with self._lock:
                    rng.streams.pop(token, None)

    def _put(self, rng: _Range, token: int, pos: int, chunk: bytes) -> int:
        """Put ``chunk`` in place at ``pos`` if ``token`` still holds the range; then hedge the
        first range in flight if it has stalled. Returns the new position."""
        with self._lock:
            if rng.token != token:
                raise _Superseded  # a late byte of a replaced attempt never lands
            end = pos + len(chunk)
            rng.view[pos:end] = chunk
            rng.filled = end
            self._pieces += 1
            rng.mark = self._pieces
            hedge = self._stalled_head()
            if hedge is not None:
                head_offset, head = hedge
                head.hedges += 1
                head.mark = self._pieces  # the hedge gets the same allowance
                new, start = self._take(head), head.filled
                self.hedged.append((head_offset, new, start))
        if hedge is not None:
            self._start_hedge(head_offset, head, new, start)
        return end

    def _stalled_head(self) -> tuple[int, _Range] | None:
        """The first range in flight, if it has stalled and may be hedged (lock held)."""
        if not self._ranges:
            return None
        head_offset = min(self._ranges)
        head = self._ranges[head_offset]
        if head.done.is_set() or head.hedges >= self.max_hedges:
            return None
        # Each hedge of a range waits twice as long as the one before: a new connection needs
        # a round trip and a slow start before its first piece, and the ranges after it go on.
        if self._pieces - head.mark < self.stall_pieces << head.hedges:
            return None
        return head_offset, head

    def _start_hedge(self, offset: int, rng: _Range, token: int, start: int) -> None:
        """Send the hedge's request (it holds the range's token already)."""
        log.info("the range at byte %d of a storage read stalled at %d of %d bytes: asked for "
                 "the rest again (hedge %d)", offset, start, len(rng.view), token - 1)  # fmt: skip
        self._spawn(offset, rng, token, start)

    def _spawn(self, offset: int, rng: _Range, token: int, start: int) -> None:
        """Run an attempt on a thread of its own: whoever waits for the range waits for the
        range, never for an attempt that may be blocked on a stalled connection (where the
        connection cannot be shut from outside, it stays blocked until the client's read
        timeout, holding nothing but its thread)."""
        threading.Thread(
            target=self._attempt, args=(offset, rng, token, start),
            name="storage-read-attempt", daemon=True,
        ).start()  # fmt: skip
