"""Whether this node still holds the writer role of a path: the check a representative's
upload makes before it starts and right before its object becomes visible.

Call order: build a :class:`WriterFence` when an upload attempt starts (it notes the lease
the role is held under), then call :meth:`WriterFence.check` each time the storage backend
consults the write guard (:class:`~ckptcache.server.cluster.election.FencedGuard`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptcache.server.cluster.coord import Coordinator, CoordinatorUnavailable, keys
from ckptcache.server.cluster.coord.records import WriterRecord, parse_one
from ckptcache.server.persist.persister import Deposed

__all__ = ["FENCE_MARGIN", "WriterFence"]

#: Lease time a write must still have left to land on the strength of the lease alone: the
#: last steps (a rename, a multipart completion) run after the check.
FENCE_MARGIN = 1.0


@dataclass
class WriterFence:
    """The writer role of path hash ``ph`` for content ``digest``, held by node ``me``.

    One coordinator read per :meth:`check`. While the coordinator cannot be reached, the role
    still holds as long as the lease it was held under is known to be alive (no successor can
    be elected before that lease lapses, so a persist completes through an etcd outage); past
    that, the node counts as deposed and never writes for its group.

    Only that lease vouches for the role. After it lapsed and the node took a new one (a
    partition healed past the TTL), a successor may have written and stepped down: the new
    lease's time says nothing about a role that went with the old one: a representative cut
    off mid-upload past its lease would complete its upload after the heal on the strength of
    the new lease, a second write of what its successor had written.
    """

    coord: Coordinator
    ph: str
    digest: str
    me: str
    epoch: int = field(init=False)

    def __post_init__(self) -> None:
        self.epoch = self.coord.lease_epoch()

    def check(self) -> None:
        """Return if the role is still this node's; raise :class:`Deposed` otherwise."""
        key = keys.writer_key(self.ph)
        try:
            holder = parse_one(WriterRecord, key, self.coord.get(key))
        except CoordinatorUnavailable as e:
            if self.coord.lease_epoch() != self.epoch:
                raise Deposed(
                    f"cannot confirm the writer role, and the lease it was held under lapsed: {e}"
                ) from e
            if self.coord.lease_remaining() > FENCE_MARGIN:
                return
            raise Deposed(f"cannot confirm the writer role: {e}") from e
        # A malformed writer record is nobody's: the writer counts as deposed.
        if holder is None or holder.node != self.me or holder.digest != self.digest:
            who = holder.node if holder else "nobody"
            raise Deposed(f"the writer role is no longer this node's (held by {who})")
