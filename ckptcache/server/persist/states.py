"""Persist-state transitions of a generation, in one place: the allowed ones are data.

``Generation.persist_state`` (a :class:`~ckptcache.wire.states.PersistState`) is changed only
through :meth:`PersistStates.advance`; no other module assigns it. :data:`TRANSITIONS` lists,
for each state, the states it may move to, each with the reason that path exists in the
daemon (read from every site that changes it: commit, recovery at start, the persist
workers and their retries, the cluster's standby and takeover, retention, supersede, delete,
orphans, corruption)::

    memory-only -> queued -> persisting -> persisted
                                        -> failed | conflict      (kept in memory, reported)
                                        -> standby -> queued       (the representative left)
                          -> superseded | dropped                 (never written)

Only ``persisted`` is terminal: a generation whose bytes are on storage never goes back.
Every other state may still end ``persisted`` (another member of its group wrote the same
content) or ``superseded`` (storage or a newer save holds a newer object).

A transition the table does not list is a bug in the daemon, never a reason to stop a
persist: in production it is applied anyway, logged at ERROR and counted (the
``ckptcache_unlisted_persist_transitions`` metric, :attr:`PersistStates.unlisted`). Under
:data:`STRICT_ENV` (the test suite sets it for every process it starts) it raises
:class:`UnlistedTransition` instead, so the whole suite proves the table complete.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Protocol

from ckptcache.errors import CkptCacheError
from ckptcache.server.metrics import Metrics
from ckptcache.wire.states import PersistState

__all__ = ["STRICT_ENV", "TRANSITIONS", "PersistStates", "UnlistedTransition"]

log = logging.getLogger(__name__)

#: Set (to anything but ``0``) to raise on an unlisted transition instead of applying it.
STRICT_ENV = "CKPTCACHE_STRICT_STATES"

_S = PersistState

# Reasons shared by several source states.
_GROUP_WROTE = "another member of the redundancy group persisted identical content"
_STORAGE_NEWER = (
    "storage holds a newer object (written through, persisted elsewhere, or found by the "
    "comparison at start): never written over it"
)
_UNORDERED = (
    "storage holds another writer's object that only clocks could order against this one "
    "(found at start, or by the background comparison of object-store paths)"
)
_DIR_REMOVED = "the directory it was saved into was removed (an orphan found by a sweep)"
_NEWER_SAVE = "a newer generation of the path was committed and will persist instead"

#: from-state -> {allowed to-state: why the daemon takes that path}.
TRANSITIONS: Mapping[PersistState, Mapping[PersistState, str]] = {
    _S.MEMORY_ONLY: {
        _S.QUEUED: "a commit, or a recovery at start, queues a save under a storage root",
        _S.PERSISTED: "its bytes are those on storage (a storage read, or a header marked "
        "persisted found at start)",
        _S.DROPPED: "found at start with its directory removed: it stays deleted",
        _S.SUPERSEDED: _STORAGE_NEWER,
        _S.CONFLICT: _UNORDERED,
    },
    _S.QUEUED: {
        _S.PERSISTING: "a persist worker took it from the queue",
        _S.SUPERSEDED: _NEWER_SAVE + "; or " + _STORAGE_NEWER,
        _S.DROPPED: "retired while queued (deleted, evicted, found corrupt) or " + _DIR_REMOVED,
        _S.CONFLICT: _UNORDERED,
    },
    _S.PERSISTING: {
        _S.PERSISTED: "the object is complete on storage (or the group's record says so)",
        _S.QUEUED: "the group's role could not be claimed yet, or the writer role was lost "
        "while writing: claimed again a second later",
        _S.STANDBY: "another member of the group writes the same content",
        _S.FAILED: "retries ran out, the bytes no longer match their digests, or an "
        "internal error stopped the worker",
        _S.CONFLICT: "storage holds another writer's object that only clocks could order",
        _S.SUPERSEDED: _NEWER_SAVE + "; or " + _STORAGE_NEWER,
        _S.DROPPED: "retired while it was written, or " + _DIR_REMOVED,
    },
    _S.STANDBY: {
        _S.QUEUED: "the group's representative is gone: this node takes over",
        _S.PERSISTED: _GROUP_WROTE,
        _S.DROPPED: "retired while another member writes it, or " + _DIR_REMOVED,
        _S.SUPERSEDED: _STORAGE_NEWER,
        _S.CONFLICT: _UNORDERED,
        _S.FAILED: "an internal error while it was handed to the group's watch",
    },
    _S.FAILED: {
        _S.PERSISTED: _GROUP_WROTE + " (a failed member keeps watching its group)",
        _S.SUPERSEDED: _NEWER_SAVE + "; or " + _STORAGE_NEWER,
        _S.DROPPED: _DIR_REMOVED,
        _S.CONFLICT: _UNORDERED,
    },
    _S.CONFLICT: {
        _S.PERSISTED: _GROUP_WROTE + " (a member in conflict keeps watching its group)",
        _S.SUPERSEDED: _NEWER_SAVE + "; or " + _STORAGE_NEWER,
        _S.DROPPED: _DIR_REMOVED,
        _S.CONFLICT: "the background comparison at start found the conflict again",
        _S.QUEUED: "a recovery's re-queue raced the background comparison: the persist's "
        "own guard finds the conflict again before anything is written",
    },
    _S.SUPERSEDED: {
        _S.SUPERSEDED: "superseded again (a later write-through or comparison)",
        _S.PERSISTED: "a persist already writing completed, or " + _GROUP_WROTE,
        _S.FAILED: "a persist already writing failed for good or found corrupt bytes",
        _S.CONFLICT: "a persist already writing met another writer's object, or " + _UNORDERED,
        _S.DROPPED: "a persist already writing found its directory removed",
    },
    _S.DROPPED: {
        _S.DROPPED: "a persist already writing found its directory removed as well",
        _S.SUPERSEDED: "a dropped generation not yet swept is superseded (" + _STORAGE_NEWER + ")",
        _S.PERSISTED: "a persist already writing completed, or " + _GROUP_WROTE,
        _S.FAILED: "a persist already writing failed for good or found corrupt bytes",
        _S.CONFLICT: "a persist already writing met another writer's object, or " + _UNORDERED,
    },
    _S.PERSISTED: {},
}


class UnlistedTransition(CkptCacheError, RuntimeError):
    """A persist-state change :data:`TRANSITIONS` does not list (raised only under
    :data:`STRICT_ENV`; otherwise applied, logged and counted)."""


class Stateful(Protocol):
    """What a transition changes: a generation's persist fields (``Generation``)."""

    path: str
    number: int
    persist_state: PersistState
    needs_persist: bool
    persisted: bool
    persist_error: str


def strict_from_env() -> bool:
    """Whether :data:`STRICT_ENV` asks to raise on unlisted transitions."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


class PersistStates:
    """Applies persist-state changes by :data:`TRANSITIONS` (callers hold the state lock)."""

    def __init__(self, metrics: Metrics | None = None, *, strict: bool | None = None):
        self.strict = strict_from_env() if strict is None else strict
        self._metrics = metrics
        #: Unlisted transitions met so far (under :attr:`strict`: raised, not applied).
        self.unlisted = 0
        #: Called (under the state lock; it must not block) when a persist ends, here or on
        #: a peer: the generation may give pages back now (``server/memory/sharer.py``).
        self.on_settled: list[Callable[[], None]] = []

    def advance(
        self,
        gen: Stateful,
        to: PersistState,
        *,
        needs_persist: bool | None = None,
        persisted: bool | None = None,
        error: str | None = None,
    ) -> None:
        """Move ``gen`` to ``to``, setting the fields given with it (None: unchanged).

        An unlisted transition is counted; under :attr:`strict` it then raises
        :class:`UnlistedTransition` (nothing changed), otherwise it is applied and logged at
        ERROR, because a guarantee (the persist goes on) comes before the table's tidiness.
        """
        was = gen.persist_state
        if to not in TRANSITIONS[was]:
            message = (
                f"unlisted persist-state transition {was} -> {to} of {gen.path} "
                f"generation {gen.number}"
            )
            self.unlisted += 1
            if self._metrics is not None:
                self._metrics.unlisted_transitions.inc()
            if self.strict:
                raise UnlistedTransition(message)
            log.error("%s (applied; a bug in the daemon)", message)
        gen.persist_state = to
        if needs_persist is not None:
            gen.needs_persist = needs_persist
        if persisted is not None:
            gen.persisted = persisted
        if error is not None:
            gen.persist_error = error
        if to != was and not (gen.needs_persist and not gen.persisted):
            for hook in self.on_settled:
                hook()
