"""Which generations may leave memory, in which order, and what is protected: one policy.

The parts that act (:class:`~ckptcache.server.saves.Saves` evicting for room,
:class:`~ckptcache.server.memory.retention.Retention` retiring beyond ``keep``) ask this policy and
decide nothing themselves; :func:`~ckptcache.server.daemon.build_core` builds it and passes it
in. Protected, in the order they are checked:

* **pinned**: a load, a transfer or a persist worker holds it (in flight);
* **the newest save of its path, not persisted yet**: the last acknowledged save of a path is
  never lost before storage has it (an orphan, whose directory the user removed, is not);
* **another user's unpersisted generation**: a save never evicts it on its behalf (see
  :mod:`~ckptcache.server.memory.shares`).

Candidates go oldest commit first. Retention beyond ``keep`` never retires a generation
storage has not received yet, newest or not.
"""

from __future__ import annotations

from ckptcache.server.memory.index import Generation, Index
from ckptcache.server.memory.shares import Shares
from ckptcache.wire.states import PersistState

__all__ = ["EvictionPolicy"]

#: Persists that ended without reaching storage: waiting does not make them evictable.
_STUCK = (PersistState.FAILED, PersistState.CONFLICT)


def unpersisted(gen: Generation) -> bool:
    """Whether storage still has to receive ``gen`` (a memory-only object never will)."""
    return gen.needs_persist and not gen.persisted


class EvictionPolicy:
    """The eviction and keep-N decisions of one daemon; every method runs under the state
    lock. ``shares``: whose generations a user's save may evict."""

    def __init__(self, shares: Shares):
        self.shares = shares

    def protection(self, gen: Generation, *, newest: bool) -> str:
        """Why ``gen`` must stay in memory ("" when it may be evicted); ``newest``: it is
        the newest generation of its path."""
        if gen.pins:
            return "pinned"
        if newest and not gen.persisted and not gen.orphaned:
            return "the newest save of its path, not persisted yet"
        return ""

    def candidates(self, index: Index) -> list[Generation]:
        """Generations that may be evicted under memory pressure, oldest commit first."""
        out = [g for g in index if not self.protection(g, newest=index.newest(g.key) is g)]
        return sorted(out, key=lambda g: g.committed)

    def victims(self, index: Index, uid: int) -> list[Generation]:
        """What a save of ``uid`` may evict, in order: never another user's unpersisted
        generation."""
        return [g for g in self.candidates(index) if self.shares.may_evict(g, uid)]

    def own_victims(self, index: Index, uid: int) -> list[Generation]:
        """What ``uid``'s user may evict of its own to get back under its share, in order."""
        user = self.shares.user_of(uid)
        return [g for g in self.candidates(index) if self.shares.owner(g) == user]

    def may_retire_beyond_keep(self, gen: Generation) -> bool:
        """Whether retention may retire ``gen`` once ``keep`` newer ones exist: never before
        storage has received it."""
        return not unpersisted(gen)

    def on_its_way(self, gen: Generation) -> bool:
        """Whether ``gen`` will become evictable by waiting: its persist has not ended
        (failed or conflict ones stay until a user acts)."""
        return unpersisted(gen) and gen.persist_state not in _STUCK
