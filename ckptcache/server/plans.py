"""Where the plans of saved structures lie, for the first save of a trainer that starts later.

A save's plan (its skeleton, tensor table and storages' records) lies in the segment of the
object it saved. The client that planned a structure afresh says so after its commit
(``keep_plan``: a digest of the structure's key, the path, and a digest binding that plan to
the key); the first save of a later trainer of the same user asks for its structure
(``find_plan``), maps the newest generation of that path and uses the plan there once its own
key and the plan's bytes give the same binding digest (:mod:`ckptcache.codec.plan.stored`).
A client made as a trainer starts reads the newest of its user's plans ahead
(``list_plans``) and checks the one its first save's key names. Nothing here is taken on
trust by the client; the daemon only answers a user with what that user kept, and forgets
the oldest entries beyond :data:`MOST`.

Kept in memory only: a restarted daemon starts without, and the next trainer's first save
plans afresh (and keeps its plan again).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from ckptcache.server.state import Session
from ckptcache.wire import messages as m

__all__ = ["MOST", "PlanIndex", "plan_index"]

#: The most structures kept (per daemon, all users together): a job saves a few.
MOST = 256
#: The most integers a kept plan carries (a structure with more plans afresh).
MOST_INTS = 4096
_DIGEST_CHARS = 64


class PlanIndex:
    """Structure digest -> where its plan lies, per user and namespace (see the module
    docstring)."""

    def __init__(self, most: int = MOST):
        self._most = most
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
        """What ``session``'s user kept for the structure (an empty reply: nothing)."""
        with self._lock:
            found = self._kept.get((session.uid, request.namespace, request.structure))
        return found if found is not None else m.FindPlanReply()

    def list(self, session: Session, request: m.ListPlansRequest) -> m.ListPlansReply:
        """The newest of what ``session``'s user kept in the namespace (a client made as a
        trainer starts reads them ahead of its first save)."""
        with self._lock:
            mine = [
                m.KeptPlan(structure, kept.path, kept.check, kept.ints)
                for (uid, namespace, structure), kept in reversed(self._kept.items())
                if uid == session.uid and namespace == request.namespace
            ]
        return m.ListPlansReply(tuple(mine[: max(0, min(request.most, 16))]))


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
            index = _indexes[id(core)] = PlanIndex()
            weakref.finalize(core, _indexes.pop, id(core), None)
        return index
