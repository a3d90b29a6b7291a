"""Each admitted user's share of the memory budget.

With admitted users (``allowed_uids``), one user could fill the whole budget with objects that
are never persisted, and every other user's saves would wait and then write through. So a
save is refused, with :class:`~ckptcache.errors.BudgetExceeded` naming the share, when its
user would hold more than its share; and eviction on a user's behalf never drops another
user's unpersisted generation.

Who counts as one user: each admitted uid; root and the daemon's own uid together (the
operator). What a user holds: the segments of its saves and copies (reserved or committed,
not the free ones kept for reuse). The share (``user_share``): by default a fair one, the
budget divided among the users holding memory now, the saver included; or a fixed fraction
of the budget. A daemon without admitted users has one user: the whole budget, as before.

A user alone may use the whole budget under the fair share; what it holds when others arrive
is not taken from it, but its next saves are refused until it is back under its share (a
fixed ``user_share`` keeps room for users who have not arrived yet).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from ckptcache._units import format_bytes
from ckptcache.server.memory.arena import Arena
from ckptcache.server.memory.index import Generation

__all__ = ["Shares", "Verdict"]

_OPERATOR = -1


@dataclass(frozen=True)
class Verdict:
    """Whether a save of ``capacity`` bytes fits its user's share."""

    fits: bool
    message: str = ""


class Shares:
    """The share rule of one daemon (``share``: None fair, else a fraction of the budget);
    every method runs under the state lock."""

    def __init__(self, arena: Arena, share: float | None, admitted: tuple[int, ...]):
        self.arena = arena
        self.share = share
        self.enabled = bool(set(admitted) - {0, os.geteuid()})

    def user_of(self, uid: int) -> int:
        """The user ``uid`` counts as (root and the daemon's uid are one)."""
        return _OPERATOR if uid in (0, self.arena.uid) else uid

    def owner(self, gen: Generation) -> int:
        """The user a generation's memory counts against."""
        return self.user_of(gen.saver.uid if gen.saver is not None else self.arena.uid)

    def held(self) -> Counter[int]:
        """Bytes each user holds (segments in use: reserved or committed)."""
        held: Counter[int] = Counter()
        for segment in self.arena.segments.values():
            if segment.name not in self.arena.free:
                held[self.user_of(segment.owner)] += segment.capacity
        return held

    def may_evict(self, gen: Generation, uid: int) -> bool:
        """Whether a save of ``uid`` may evict ``gen`` (an eviction candidate): its own, or
        another user's only once that is persisted (or its directory is gone)."""
        if not self.enabled or gen.persisted or gen.orphaned:
            return True
        return self.owner(gen) == self.user_of(uid)

    def check(self, uid: int, capacity: int, what: str) -> Verdict:
        """Whether ``uid`` may take ``capacity`` more bytes (for ``what``, named in the
        message); the message says the share, how it was set and what the user holds."""
        if not self.enabled:
            return Verdict(True)
        held = self.held()
        user = self.user_of(uid)
        limit = self.arena.limit
        if self.share is None:
            users = len(set(held) | {user})
            share = limit // users
            how = f"a fair share: {format_bytes(limit)} among {users} users holding memory"
        else:
            share = int(limit * self.share)
            how = f"user_share {self.share:g} of {format_bytes(limit)}"
        mine = held.get(user, 0)
        if mine + capacity <= share:
            return Verdict(True)
        who = "root and the daemon's uid" if user == _OPERATOR else f"uid {uid}"
        return Verdict(
            False,
            f"no room for {what} within the share of {who} of the memory budget: its share "
            f"is {format_bytes(share)} ({how}) and it holds {format_bytes(mine)}. Delete what "
            "is not needed (ckptcache rm PATH), save under a --persist-root (persisted copies "
            "make room), or raise --memory-limit or user_share",
        )
