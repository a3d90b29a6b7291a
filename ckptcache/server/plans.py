"""Where the plans of saved structures lie, for the first save of a trainer that starts later.

A save's plan (its skeleton, tensor table and storages' records) lies in the segment of the
object it saved. The client that planned a structure afresh says so after its commit
(``keep_plan``: a digest of the structure's key, the path, and a digest binding that plan to
the key); the first save of a later trainer of the same user asks for its structure
(``find_plan``), reads the plan from the segment file of that path's newest generation here
(the reply says which, and where its manifest lies) and uses it once its own key and the
plan's bytes give the same binding digest (:mod:`ckptcache.codec.plan.stored`). A client made
as a trainer starts reads the newest of its user's plans ahead (``list_plans``) and checks
the one its first save's key names. Nothing here is taken on trust by the client; the daemon
only answers a user with what that user kept, points only at generations that user may
load, and forgets the oldest entries beyond :data:`MOST`.

No generation is pinned for a plan: the client reads the segment's file, not a mapping, and
a segment reused or cut meanwhile gives bytes whose digest is not the kept one (or a short
read), so the save plans afresh. A pin, and the ``open`` that takes it (in a cluster, a
request to the coordinator), would cost a job's first save more than the read.

Kept in memory only: a restarted daemon starts without, and the next trainer's first save
plans afresh (and keeps its plan again).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ckptcache.errors import CheckpointNotFound, InvalidPath
from ckptcache.server.state import CacheState, Session
from ckptcache.wire import messages as m

__all__ = ["MOST", "PlanIndex", "Where", "newest_here", "plan_index"]

#: The most structures kept (per daemon, all users together): a job saves a few.
MOST = 256
#: The most integers a kept plan carries (a structure with more plans afresh).
MOST_INTS = 4096
_DIGEST_CHARS = 64

#: Where a path's newest generation lies for a user: its segment, manifest offset and size
#: (``None``: none here that the user may load).
Where = Callable[[Session, str, str], "tuple[str, int, int] | None"]


def _nowhere(session: Session, namespace: str, path: str) -> None:
    return None


def newest_here(state: CacheState) -> Where:
    """:data:`Where` on ``state``: the newest sound generation of the path this node holds
    that ``session`` may load."""

    def where(session: Session, namespace: str, path: str) -> tuple[str, int, int] | None:
        with state.lock.held():
            try:
                gen = state.lookup_visible_locked(namespace, path, None, session, load=True)
            except (CheckpointNotFound, InvalidPath):
                return None
            if gen.corrupt:
                return None
            header = gen.segment.read_header()
            return gen.segment.name, header.manifest_offset, header.manifest_size

    return where


class PlanIndex:
    """Structure digest -> where its plan lies, per user and namespace (see the module
    docstring); ``where`` finds the newest generation of a kept path."""

    def __init__(self, most: int = MOST, where: Where = _nowhere):
        self._most = most
        self._where = where
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[int, str, str], m.FindPlanReply] = OrderedDict()

    def keep(self, session: Session, request: m.KeepPlanRequest) -> None:
        """Remember ``request`` for ``session``'s user; a malformed one is not kept."""
        if not (_digest(request.structure) and _digest(request.check)):
            raise ValueError("structure and check must be hex digests")
        if len(request.ints) > MOST_INTS:
            return
        key = (session.uid, request.namespace, request.structure)
        with self._lock:
            self._kept.pop(key, None)
            self._kept[key] = m.FindPlanReply(request.path, request.check, request.ints)
            while len(self._kept) > self._most:
                self._kept.popitem(last=False)

    def find(self, session: Session, request: m.FindPlanRequest) -> m.FindPlanReply:
        """What ``session``'s user kept for the structure, and where it lies now (an empty
        reply: nothing kept)."""
        with self._lock:
            found = self._kept.get((session.uid, request.namespace, request.structure))
        if found is None:
            return m.FindPlanReply()
        return self._located(session, request.namespace, found)

    def list(self, session: Session, request: m.ListPlansRequest) -> m.ListPlansReply:
        """The newest of what ``session``'s user kept in the namespace, each with where it
        lies now (a client made as a trainer starts reads them ahead of its first save)."""
        with self._lock:
            mine = [
                (structure, kept)
                for (uid, namespace, structure), kept in reversed(self._kept.items())
                if uid == session.uid and namespace == request.namespace
            ][: max(0, min(request.most, 16))]
        plans = []
        for structure, kept in mine:
            at = self._located(session, request.namespace, kept)
            plans.append(m.KeptPlan(structure, at.path, at.check, at.ints, at.segment,
                                    at.manifest_offset, at.manifest_size))  # fmt: skip
        return m.ListPlansReply(tuple(plans))

    def _located(self, session: Session, namespace: str, kept: m.FindPlanReply) -> m.FindPlanReply:
        """``kept`` with where its path's newest generation lies now (not under our lock)."""
        where = self._where(session, namespace, kept.path)
        if where is None:
            return kept
        segment, offset, size = where
        return dataclasses.replace(kept, segment=segment, manifest_offset=offset,
                                   manifest_size=size)  # fmt: skip


def _digest(text: str) -> bool:
    return len(text) == _DIGEST_CHARS and all(c in "0123456789abcdef" for c in text)


#: One index per daemon core (a test may run several cores in one process), by ``id``: a
#: core is not hashable; its entry goes with it.
_indexes: dict[int, PlanIndex] = {}
_indexes_lock = threading.Lock()


def plan_index(core: Any) -> PlanIndex:
    """The plan index of the daemon whose core is ``core``."""
    with _indexes_lock:
        index = _indexes.get(id(core))
        if index is None:
            index = _indexes[id(core)] = PlanIndex(where=newest_here(core.state))
            weakref.finalize(core, _indexes.pop, id(core), None)
        return index
