"""Leases of loads and of staging copies, dropped one way (a release or the connection's end).

A load's lease pins a generation that others may still use: dropping it only unpins. A
staging copy (``commit_pinned``, :attr:`~ckptcache.server.index.Generation.staged`) exists for
the one lease its commit took: dropping that lease also takes the copy out of the index, so its
memory is free again whether the trainer released it or died.
"""

from __future__ import annotations

from ckptcache.server.index import Generation
from ckptcache.server.state import CacheState

__all__ = ["drop_lease_locked"]


def drop_lease_locked(state: CacheState, gen: Generation) -> None:
    """Drop one lease's pin on ``gen`` (under the state lock); a staging copy is retired too
    (its segment is freed with the pin, or once every mapping of it is gone)."""
    if gen.staged and not gen.removed:
        state.retire_locked(gen)
    state.unpin_locked(gen)
