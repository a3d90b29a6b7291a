"""A writer thread for streamed local writes: the producer's own work (hashing, CRC-32s,
headers, gathering small records) runs while the previous pieces are copied into the page
cache and written back, instead of between those writes.

On the producer's own thread, the time it spends between writes would leave the disk idle
(``benchmarks/persist/README.md``).

Pieces are handed over, not copied: a producer must not change a piece's bytes after passing
it to the sink (every producer in the project passes views of sealed memory or fresh
objects). At most :data:`QUEUED` bytes wait; the producer waits beyond that. The write is
over only when :meth:`Handoff.finish` returns, so the caller's ``fsync`` still comes after
every byte; an error of the writer thread is raised on the producer's side.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sized
from typing import Generic, TypeVar

__all__ = ["GATHERED", "QUEUED", "SMALL_PIECE", "Gather", "Handoff", "threaded"]

#: Bytes handed over and not yet written, at most (four of the persist's 8 MiB writes).
QUEUED = 32 << 20
#: Pieces below this are gathered into larger writes by :class:`Gather` (copied once more:
#: cheap next to a write and its queue round).
SMALL_PIECE = 1 << 20
#: What :class:`Gather` gathers small pieces into.
GATHERED = 8 << 20

Write = Callable[[bytes | memoryview], None]
T = TypeVar("T")


class Handoff(Generic[T]):
    """Items from a producer thread to one writer thread, in order. An item counts ``size(item)``
    bytes against :data:`QUEUED` (by default its length: a piece of bytes) until it is
    written."""

    def __init__(
        self,
        write: Callable[[T], None],
        *,
        queued: int = QUEUED,
        size: Callable[[T], int] | None = None,
    ):
        self._write = write
        self._limit = queued
        self._size: Callable[[T], int] = size or _length
        self._pieces: deque[T] = deque()
        self._queued = 0
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        # The thread inherits the caller's CPU and I/O priority (the persist worker's).
        self._thread = threading.Thread(target=self._run, name="ckptcache-write", daemon=True)
        self._thread.start()

    def put(self, piece: T) -> None:
        """Queue ``piece`` (waits while :data:`QUEUED` bytes are queued); raises the writer's
        error if it failed."""
        size = self._size(piece)
        with self._cond:
            while self._error is None and self._queued and self._queued + size > self._limit:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            self._pieces.append(piece)
            self._queued += size
            self._cond.notify_all()

    def finish(self) -> None:
        """Wait until every queued piece is written; raise the writer's error if any."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Drop what is queued and wait for the writer to stop (the producer failed): the
        file descriptor may be closed once this returns."""
        with self._cond:
            self._closed = True
            self._pieces.clear()
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pieces and not self._closed:
                    self._cond.wait()
                if not self._pieces:
                    return
                piece = self._pieces.popleft()
            try:
                self._write(piece)
            except BaseException as e:  # raised on the producer's side
                with self._cond:
                    self._error = e
                    self._pieces.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._queued -= self._size(piece)
                self._cond.notify_all()
            del piece


def _length(item: object) -> int:
    assert isinstance(item, Sized)
    return len(item)


class Gather:
    """Small pieces (under :data:`SMALL_PIECE`) joined into writes of :data:`GATHERED` bytes
    before they reach ``sink``: an archive of thousands of small tensors is three pieces per
    record (header, data, descriptor), each a queue round and a system call otherwise. Larger
    pieces pass through as they are, after what was gathered before them."""

    def __init__(self, sink: Write):
        self._sink = sink
        self._pending = bytearray()

    def write(self, piece: bytes | memoryview) -> None:
        """Take the next piece."""
        if len(piece) >= SMALL_PIECE:
            self.flush()
            self._sink(piece)
            return
        self._pending += piece
        if len(self._pending) >= GATHERED:
            self.flush()

    def flush(self) -> None:
        """Pass on what is gathered."""
        if self._pending:
            self._sink(memoryview(self._pending))
            self._pending = bytearray()  # the one passed on is the writer's now


def threaded(produce: Callable[[Write], None], write: Write) -> None:
    """Run ``produce`` on this thread with its pieces written by ``write`` on another (small
    ones gathered, see :class:`Gather`); return once all are written, or raise (the
    producer's error first) with the writer stopped."""
    handoff: Handoff[bytes | memoryview] = Handoff(write)
    gather = Gather(handoff.put)
    try:
        produce(gather.write)
        gather.flush()
    except BaseException:
        handoff.abort()
        raise
    handoff.finish()
