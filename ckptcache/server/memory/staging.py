"""Leases of loads and of staging copies, dropped one way (a release or the connection's end).

A load's lease pins a generation that others may still use: dropping it only unpins. A
staging copy (``commit_pinned``, :attr:`~ckptcache.server.memory.index.Generation.staged_by`) exists
for the one lease its commit took: dropping that lease also takes the copy out of the index, so
its memory is free again whether the trainer released it or died.
"""

from __future__ import annotations

from ckptcache.server.memory.index import Generation
from ckptcache.server.state import CacheState

__all__ = ["drop_lease_locked"]


def drop_lease_locked(state: CacheState, lease: int, gen: Generation) -> None:
    """Drop the pin of ``lease`` on ``gen`` (under the state lock); the lease that holds a
    staging copy retires it too (its segment is freed with the last pin, and reused once no
    mapping of it is left)."""
    if gen.staged_by == lease and not gen.removed:
        state.retire_locked(gen)
    state.unpin_locked(gen)
