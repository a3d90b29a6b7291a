"""Striped relays: a copy still arriving at this node forwarded to the next node on several
connections at once, each stripe sent from the ranges of the copy that have landed here.

A relay on one connection forwards the copy's bytes in the order they land and is bounded by
one core per end, as any single connection of the data plane is (see
:mod:`ckptcache.server.cluster.stripes`). A striped relay splits it:

* :func:`plan` cuts the body into blocks of ``block`` bytes along its *lanes* (the ranges that
  land side by side at the relaying node, :attr:`~ckptcache.server.state.Inflight.lanes`: one
  for a storage read, which lands in file order, one per stripe for a copy that arrives in
  stripes), orders them by when they are due (the first block of every lane, then the second,
  ...), and deals them round robin to the stripes. Each stripe's next block is then one that
  lands about now, whatever the lanes, so every stripe moves while the copy lands. Both ends
  compute the plan from the :class:`~ckptcache.wire.peer.RelayHead`; the receiving node's
  copy lands in the same lanes, so the next hop of a chain is striped the same way.
* :func:`send_blocks` sends one stripe's blocks, each byte once it is final here
  (:meth:`~ckptcache.server.state.CacheState.wait_landed`: in place and authenticated, or read
  from storage); a copy that fails here fails every stripe's connection.
* :class:`Relays` are the striped relays this node serves, by token: only the node that asked
  for one may join it, each stripe once, and never one whose copy failed here.
* :class:`RelaySink` is the receiving end: each stripe's connection lands its blocks in place;
  how far each lane is in place is reported to this node's own copy in flight (relays of it
  follow each lane); a failed, cut or tampered stripe fails the whole transfer, and no stripe
  writes into the view once :func:`receive` returns. Every record is authenticated as it
  lands; the copy's digests are checked against its table (which lands last, once the origin
  checked the whole copy) where it is committed, as for a relay on one connection.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptcache.errors import ProtocolMismatch, ReplicationError
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.server.cluster import stripes, transfer
from ckptcache.server.cluster.dataplane import Channel, send_msg
from ckptcache.server.state import Landing
from ckptcache.wire import peer

if TYPE_CHECKING:
    from ckptcache.server.state import CacheState, Inflight

__all__ = ["BLOCK", "MIN_BLOCK", "Block", "RelaySink", "Relays", "plan", "receive", "refused",
           "send_blocks", "streams_for"]  # fmt: skip

log = logging.getLogger(__name__)

#: Bytes of a block: a stripe waits for each of its blocks to land, then moves to the next,
#: so a block is the unit of balance between stripes; large enough that a stripe's Python
#: work per block (a wait, a ``recv_into`` call) is lost in its transfer.
BLOCK = 8 << 20

#: The smallest block a receiving node accepts (a plan's size is the body over the block).
MIN_BLOCK = 64 << 10

#: One block of a plan: its lane, and its ``[lo, hi)`` in the body.
Block = tuple[int, int, int]


def streams_for(body: int, streams: int) -> int:
    """The stripes a relay of ``body`` bytes uses with ``streams`` offered: as for a push or a
    fetch, none under :data:`~ckptcache.server.cluster.stripes.MIN_STRIPE` bytes."""
    return max(1, min(streams, body // max(1, stripes.MIN_STRIPE)))


def plan(body: int, lanes: Sequence[int], streams: int, block: int) -> list[list[Block]]:
    """The blocks of each of ``streams`` stripes of a relayed body of ``body`` bytes that
    lands in ``lanes`` (their starts): each lane cut in ``block``-byte blocks from its start,
    ordered by position in the lane, then lane, and dealt round robin."""
    per_lane = [[(i, lo, min(lo + block, hi)) for lo in range(lo, hi, block)]
                for i, (lo, hi) in enumerate(stripes.ranges(list(lanes), body))]  # fmt: skip
    due = [b for row in itertools.zip_longest(*per_lane) for b in row if b is not None]
    return [due[j::streams] for j in range(streams)]


def send_blocks(channel: Channel, state: CacheState, flight: Inflight, blocks: list[Block]) -> None:
    """Send ``blocks`` of ``flight`` (a copy arriving here) on ``channel``, in order, each
    byte once it is final here, in relay records (a hop adds about one record's time)."""
    with state.relaying(flight, channel), flight.segment.opened() as fd:
        for _lane, lo, hi in blocks:
            pos = lo
            while pos < hi:
                ready = min(hi, state.wait_landed(flight, pos))
                channel.send_file(fd, HEADER_SIZE + pos, ready - pos, flight.segment.mapping,
                                  record=transfer.RELAY_RECORD)  # fmt: skip
                pos = ready
        channel.until_read(state.config.dead_peer_timeout)  # sendfile queued the pages


@dataclass
class _Served:
    """One striped relay this node serves."""

    flight: Inflight
    peer_id: str
    blocks: list[list[Block]]
    claimed: set[int] = field(default_factory=set)


class Relays:
    """The striped relays this node is serving, by token.

    Call order: :meth:`open` (on the fetch's connection, for as long as it serves the relay:
    until the fetching node says every stripe is in, or hangs up) -> :meth:`join` (on each
    other stripe's connection) -> :func:`send_blocks` of the stripe joined."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: dict[str, _Served] = {}

    @contextlib.contextmanager
    def open(self, flight: Inflight, peer_id: str, blocks: list[list[Block]]) -> Iterator[str]:
        """A relay of ``flight`` to ``peer_id`` in ``blocks``' stripes, joinable under the
        token yielded for the block (stripe 0 is the caller's)."""
        token = secrets.token_hex(16)
        with self._lock:
            self._served[token] = _Served(flight, peer_id, blocks, {0})
        try:
            yield token
        finally:
            with self._lock:
                del self._served[token]

    def join(self, token: str, index: int, peer_id: str) -> tuple[Inflight, list[Block]] | None:
        """The copy and the blocks of stripe ``index`` of relay ``token``; None unless that
        relay is open, was asked for by ``peer_id``, the stripe is free and the copy has not
        failed here."""
        with self._lock:
            served = self._served.get(token)
            if (served is None or served.peer_id != peer_id or served.flight.failed
                    or not 0 <= index < len(served.blocks) or index in served.claimed):  # fmt: skip
                return None
            served.claimed.add(index)
            return served.flight, served.blocks[index]


class RelaySink(stripes.Joined):
    """The receiving end of a striped relay into ``view`` (the segment body): each stripe's
    connection calls :meth:`receive`; ``advance(n)`` reports the prefix of the view that is in
    place and authenticated, or ``lane(i, end)`` (when given, instead) how far lane ``i`` is
    (a :class:`~ckptcache.server.state.Landing` moves the prefix with its lanes)."""

    def __init__(
        self,
        view: memoryview,
        blocks: list[list[Block]],
        lanes: Sequence[int],
        peer_id: str,
        advance: Callable[[int], None],
        lane: Callable[[int, int], None] | None = None,
    ):
        super().__init__(len(blocks), peer_id)
        self.view, self.blocks = view, blocks
        self._bounds = stripes.ranges(list(lanes), len(view))
        #: Each lane's blocks in order (their ``[lo, hi)``), how much of each has landed, and
        #: the first one not whole: a lane is final up to there.
        self._lane_blocks = [sorted((lo, hi) for ln, lo, hi in itertools.chain(*blocks) if ln == i)
                             for i in range(len(self._bounds))]  # fmt: skip
        self._place = {b: k for bs in self._lane_blocks for k, b in enumerate(bs)}
        self._got = [[0] * len(bs) for bs in self._lane_blocks]
        self._front = [0] * len(self._bounds)
        self._advance, self._lane = advance, lane
        self._reported = 0

    def receive(self, index: int, channel: Channel) -> None:
        """Land stripe ``index``'s blocks (claimed by ``channel``) from its records; a failure
        is kept for :meth:`wait` and raised here too."""
        try:
            for lane, lo, hi in self.blocks[index]:
                landed = _bind(self._landed_at, lane, self._place[lo, hi])
                channel.recv_into(self.view[lo:hi], landed)
        except BaseException as e:
            self.fail(e)
            raise
        finally:
            self.release(channel)
        self.finished(index)

    def _landed_at(self, lane: int, k: int, n: int) -> None:
        with self._changed:
            self._got[lane][k] = n
            blocks, got = self._lane_blocks[lane], self._got[lane]
            front = self._front[lane]
            while front < len(blocks) and got[front] >= blocks[front][1] - blocks[front][0]:
                front += 1
            self._front[lane] = front
            end = self._bounds[lane][1] if front == len(blocks) else blocks[front][0] + got[front]
            if self._lane is not None:  # it moves the prefix too: one report per record
                self._lane(lane, end)
                return
            prefix = 0
            for i, (_lo, hi) in enumerate(self._bounds):
                bs, f = self._lane_blocks[i], self._front[i]
                prefix = hi if f == len(bs) else bs[f][0] + self._got[i][f]
                if prefix < hi:
                    break
            if prefix > self._reported:
                self._reported = prefix
                self._advance(prefix)  # under the lock: reports stay in order


def _bind(fn: Callable[[int, int, int], None], a: int, b: int) -> Callable[[int], None]:
    """``fn`` with its first two arguments bound (typed, unlike :func:`functools.partial`)."""
    return lambda n: fn(a, b, n)


def receive(
    channel: Channel,
    view: memoryview,
    head: peer.RelayHead,
    streams: int,
    advance: Callable[[int], None],
    pull: Callable[[int], AbstractContextManager[Channel]],
) -> None:
    """Receive a striped relay announced by ``head`` (at most ``streams`` stripes, as this node
    asked) into ``view`` (the whole segment body): stripe 0 on ``channel``, each other one on
    the connection ``pull(index)`` opens (asked for with :class:`~ckptcache.wire.peer.RelayStripe`
    and answered), all at once; then tell the relaying node it may close the relay. No stripe
    outlives the call; the first failure is raised."""
    if head.streams > streams or head.block < MIN_BLOCK or head.lanes[-1] >= len(view):
        raise ProtocolMismatch(
            f"relay of {head.path!r} from {channel.peer_id}: {head.streams} stripes of "
            f"{head.block}-byte blocks in lanes {list(head.lanes)} do not fit what was asked"
        )
    blocks = plan(len(view), head.lanes, head.streams, head.block)
    landing = advance if isinstance(advance, Landing) else None
    if landing is not None:
        landing.lanes(head.lanes)  # the next hop follows the same lanes
    sink = RelaySink(view, blocks, head.lanes, channel.peer_id, advance,
                     landing.lane if landing is not None else None)  # fmt: skip

    def one(index: int) -> None:
        try:
            with pull(index) as stripe:
                if sink.claim(index, stripe):
                    sink.receive(index, stripe)
        except BaseException as e:  # kept for the first connection's thread to raise
            sink.fail(e)

    threads = [threading.Thread(target=one, args=(i,), name=f"relay-stripe-{i}", daemon=True)
               for i in range(1, len(blocks))]  # fmt: skip
    for t in threads:
        t.start()
    try:
        if not sink.claim(0, channel):
            raise ConnectionError("striped relay cancelled")
        sink.receive(0, channel)
        sink.wait()
        # Every stripe is in: the relay may close. Only a courtesy (the copy is checked
        # against its digests where it is committed), so a relaying node gone by now fails
        # nothing.
        with contextlib.suppress(OSError):
            send_msg(channel, peer.encode(peer.Ack()))
    except BaseException as e:
        if sink.error is not None and sink.error is not e:
            raise sink.error from e  # the stripe that failed first says why
        raise
    finally:
        sink.cancel()
        for t in threads:
            t.join()


def refused(index: int, peer_id: str, why: str) -> ReplicationError:
    """The error of a stripe the relaying node refused."""
    return ReplicationError(f"{peer_id} refused relay stripe {index}: {why}")
