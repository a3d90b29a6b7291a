"""Parallel streams: one transfer's body split across several connections (and cores).

One connection of the data plane is bounded by one core per end (the kernel's copy, the record
tags and the digests of its bytes all run on the threads of that connection), so a node whose
link carries more than a core moves splits a large object into *stripes*: contiguous ranges of
the segment body, each sent on a connection of its own, tagged and hashed on its own threads.

* :func:`plan` cuts the body into at most ``streams`` equal stripes of at least
  ``min_stripe`` bytes (the receiver plans, the sender follows the starts it is told). A
  storage that lies in one stripe is hashed by the connection that carries it, in the pass
  that checks each record's tag; one that a cut splits (a tensor larger than a stripe) is
  hashed once every stripe is in, one more pass over its bytes (a digest pass costs a third of
  a tag's, see benchmarks/replication/README.md), so every storage is still checked whole.
* :class:`StripeSink` is the receiving end of one striped transfer: each connection fills its
  stripe of the same view and hashes its storages; the first bytes still reach relays as a
  prefix (``advance``); a failed stripe fails the transfer, and nobody leaves the view while a
  stripe may still write into it.
* :class:`Sinks`: the transfers a node is receiving, by the token that names each on its
  other connections (only the node that offered it may join one).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.digest import digest_bytes
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import Manifest
from ckptcache.server.cluster.dataplane import Channel
from ckptcache.server.cluster.landing import LandingDigests
from ckptcache.wire.states import Tier

__all__ = ["MIN_STRIPE", "Joined", "Sinks", "StripeSink", "auto_streams", "plan"]

#: Where a cut may fall: page-aligned, so each stripe's records land on whole pages.
ALIGN = 4096

#: Bytes a stripe carries at least: an extra connection costs a handshake (two HMACs and a
#: round trip) and two threads, worth it only when its share of the object takes far longer
#: than that to move.
MIN_STRIPE = 16 << 20


def auto_streams(setting: int) -> int:
    """The streams one transfer of this node may use: ``setting``, or for 0 (auto) half the
    cores this process may run on (the daemon's share of the node, the other half left to
    the trainer), at least 1 and at most 8."""
    if setting > 0:
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


def plan(manifest: Manifest, body: int, streams: int, min_stripe: int | None = None) -> list[int]:
    """Where each stripe of the segment body ``[0, body)`` starts: ``[0, ...]``, at most
    ``streams`` stripes of about equal size and at least ``min_stripe`` bytes (by default
    :data:`MIN_STRIPE`), cut on :data:`ALIGN` (offsets relative to the body). ``manifest``
    is the object's (kept for a plan that would weigh its storages)."""
    if min_stripe is None:
        min_stripe = MIN_STRIPE
    count = max(1, min(streams, body // max(1, min_stripe)))
    starts = [0]
    for j in range(1, count):
        cut = body * j // count // ALIGN * ALIGN
        if cut > starts[-1]:
            starts.append(cut)
    return starts


def ranges(starts: list[int], body: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` of each stripe planned by :func:`plan`."""
    return list(zip(starts, [*starts[1:], body], strict=True))


class Joined:
    """The stripes of one transfer arriving on several connections at once: each is claimed
    by one connection, which writes into a shared view; a failed stripe fails them all, and
    nobody leaves the view while a stripe may still write into it.

    Call order: :meth:`claim` (per stripe, by its connection) -> the stripe's bytes ->
    :meth:`finished` or :meth:`fail`, then :meth:`release`; the transfer's owner
    waits for every stripe (:meth:`wait`) and cancels whatever is left (:meth:`cancel`)."""

    def __init__(self, count: int, peer_id: str):
        self.peer_id = peer_id
        self._changed = threading.Condition()
        self._done = [False] * count
        self._claimed = [False] * count
        self._active: set[Channel] = set()
        self._error: BaseException | None = None
        self._cancelled = False

    def claim(self, index: int, channel: Channel) -> bool:
        """Take stripe ``index`` for ``channel`` (once; not after a failure or cancel)."""
        with self._changed:
            if (self._cancelled or self._error is not None or not 0 <= index < len(self._done)
                    or self._claimed[index]):  # fmt: skip
                return False
            self._claimed[index] = True
            self._active.add(channel)
            return True

    def finished(self, index: int) -> None:
        """Stripe ``index`` is in."""
        with self._changed:
            self._done[index] = True
            self._changed.notify_all()

    def release(self, channel: Channel) -> None:
        """``channel`` no longer writes into the view (idempotent)."""
        with self._changed:
            self._active.discard(channel)
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """Fail the transfer with ``error`` (unless one failed first): every stripe stops."""
        with self._changed:
            if self._error is None:
                self._error = error
            for channel in self._active:
                _hang_up(channel)  # the others stop at once
            self._changed.notify_all()

    def wait(self) -> None:
        """Until every stripe is in; raises the first stripe's failure."""
        with self._changed:
            while not all(self._done) and self._error is None:
                self._changed.wait()
            if self._error is not None:
                raise self._error

    @property
    def error(self) -> BaseException | None:
        """The first stripe's failure, if one failed."""
        return self._error

    def cancel(self) -> None:
        """Stop every stripe still arriving and wait until none writes into the view."""
        with self._changed:
            self._cancelled = True
            for channel in self._active:
                _hang_up(channel)
            while self._active:
                self._changed.wait()


class StripeSink(Joined):
    """The receiving end of one transfer split into stripes of ``view`` (the segment body):
    each stripe's connection calls :meth:`receive`; :meth:`wait` returns once every stripe is
    in and hashed, or raises the first failure (the sender closes the transfer, its digest
    table on the first connection, only once every stripe was acknowledged, so the caller
    waits after that, and it returns at once). ``advance(n)`` reports the prefix of the view
    that is in place and authenticated, for relays, as the stripes fill, and ``lane(i, end)``
    (when given) how far stripe ``i`` is, so that a relay may follow each stripe."""

    def __init__(
        self,
        view: memoryview,
        manifest: Manifest,
        starts: list[int],
        body: int,
        peer_id: str,
        advance: Callable[[int], None],
        lane: Callable[[int, int], None] | None = None,
    ):
        self.ranges = ranges(starts, body)
        super().__init__(len(self.ranges), peer_id)
        self.view, self.manifest = view, manifest
        self.digests: list[int] = [0] * len(manifest.storages)
        #: Storages that a cut splits: hashed by :meth:`finish`, once every stripe is in.
        self.split = [i for i, s in enumerate(manifest.storages)
                      if not any(lo <= s.offset - HEADER_SIZE
                                 and s.offset - HEADER_SIZE + s.nbytes <= hi
                                 for lo, hi in self.ranges)]  # fmt: skip
        self._advance = advance
        self._lane = lane
        self._landed = [lo for lo, _hi in self.ranges]  # each stripe's end so far
        self._reported = 0

    def receive(self, index: int, channel: Channel) -> None:
        """Fill stripe ``index`` (claimed by ``channel``) from its records and hash its
        storages; a failure is kept for :meth:`wait` and raised here too."""
        lo, hi = self.ranges[index]
        hasher = LandingDigests(self.manifest, lo, hi, self.digests)
        try:
            channel.recv_into(self.view[lo:hi], lambda n: self._landed_at(index, lo + n), hasher)
            if not hasher.complete:  # every byte of the stripe was reported; never expected
                raise CorruptCheckpoint(f"stripe {index} of {self.manifest.path!r} ended before "
                                        "its last tensor", tier=Tier.PEER)  # fmt: skip
        except BaseException as e:
            self.fail(e)
            raise
        finally:
            self.release(channel)
        self.finished(index)

    def _landed_at(self, index: int, end: int) -> None:
        with self._changed:
            self._landed[index] = end
            if self._lane is not None:
                self._lane(index, end)
            prefix = 0
            for (_lo, hi), landed in zip(self.ranges, self._landed, strict=True):
                prefix = landed
                if landed < hi:
                    break
            if prefix > self._reported:
                self._reported = prefix
                self._advance(prefix)  # under the lock: reports stay in order

    def report(self, end: int) -> None:
        """Report the first ``end`` bytes of the view final (past the body: the table)."""
        with self._changed:
            if end > self._reported:
                self._reported = end
                self._advance(end)

    def finish(self) -> list[int]:
        """Every storage's digest, once :meth:`wait` returned: those a cut split are hashed
        now, the others were hashed as their stripe arrived."""
        for i in self.split:
            s = self.manifest.storages[i]
            start = s.offset - HEADER_SIZE
            self.digests[i] = digest_bytes(self.view[start : start + s.nbytes])
        return self.digests


def _hang_up(channel: Channel) -> None:
    """Wake the thread reading ``channel`` (it sees the end of the stream)."""
    with contextlib.suppress(OSError):
        channel.sock.shutdown(socket.SHUT_RDWR)


class Sinks:
    """The striped transfers this node is receiving, by token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[str, StripeSink] = {}

    @contextlib.contextmanager
    def open(self, token: str, sink: StripeSink) -> Iterator[StripeSink]:
        """``sink`` joinable under ``token`` for the block; at its end (whatever the outcome)
        it is gone, and no stripe writes into its view any more."""
        with self._lock:
            if token in self._sinks:
                raise ValueError("transfer token already in use")
            self._sinks[token] = sink
        try:
            yield sink
        finally:
            with self._lock:
                del self._sinks[token]
            sink.cancel()

    def join(self, token: str, index: int, channel: Channel) -> StripeSink | None:
        """The sink of ``token`` with stripe ``index`` claimed for ``channel``; None unless
        that transfer is open, was offered by the same node, and the stripe is free."""
        with self._lock:
            sink = self._sinks.get(token)
        if sink is None or sink.peer_id != channel.peer_id or not sink.claim(index, channel):
            return None
        return sink
