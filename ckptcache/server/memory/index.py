"""The index: which generations of which paths are committed and pinned (which of them may
be dropped is :mod:`ckptcache.server.memory.eviction`'s decision).

Not thread-safe on its own; the daemon core calls it under its lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ckptcache.format.manifest import Manifest
from ckptcache.server.memory.arena import Segment
from ckptcache.server.ownership import Saver
from ckptcache.wire.states import PersistState

__all__ = ["Generation", "Index", "Key"]

Key = tuple[str, str]  # (namespace, path)


@dataclass(eq=False)
class Generation:
    """One committed generation of a path, living in one segment."""

    namespace: str
    path: str
    number: int
    segment: Segment
    manifest: Manifest
    size: int
    #: When its content was committed (wall clock, s): here for a save, on its origin for a
    #: copy from a peer, the read's start (an upper bound) for a storage read.
    committed: float = field(default_factory=time.time)
    #: The same in ns (recorded in the segment header); storage objects newer than this are
    #: never replaced by this generation.
    committed_ns: int = 0
    #: For a save of this node: the stamp of the cluster's newest save of the path when it
    #: began (:mod:`ckptcache.server.cluster.truth`); -1 for a copy or a recovered generation.
    seen_ns: int = -1
    #: Deepest ancestor directory of the path that existed at save time ("" for URLs); see
    #: :mod:`ckptcache.server.persist.lineage`.
    anchor: str = ""
    #: Identity of the object on storage when this generation was saved ("" none, None not
    #: known); see :class:`ckptcache.storage.base.WriteGuard`.
    base: str | None = None
    #: An object-store path whose base is taken when its persist starts (a HEAD is too slow
    #: for the save itself).
    observe_base: bool = False
    #: Identity of the object this generation wrote to storage (files; "" unknown): a
    #: different one there later means another node replaced it, and loads read storage.
    stored: str = ""
    #: The directory the path was saved into was removed since: evictable, never persisted.
    orphaned: bool = False
    pins: int = 0
    digests: list[int] | None = None
    #: The digests its storages at these offsets must have: kept in the segment by the save
    #: from an earlier generation (``CommitRequest.kept``), checked when it is digested.
    expected: dict[int, int] | None = None
    #: Removed from the index while pinned: the segment is freed when the last pin goes.
    retired: bool = False
    #: Out of the index for good (deleted, evicted, superseded, dropped): never pinned
    #: again, never persisted; its segment may already hold another object.
    removed: bool = False
    #: Set by persistence; an unpersisted newest generation is never evicted.
    persisted: bool = False
    #: Whether this object must reach storage at all (False for memory-only objects).
    needs_persist: bool = False
    #: Changed only through :mod:`ckptcache.server.persist.states` (its table of transitions).
    persist_state: PersistState = PersistState.MEMORY_ONLY
    persist_error: str = ""
    persist_seconds: float = 0.0
    #: Why these bytes are known to be corrupt (found while persisting): never served.
    corrupt: str = ""
    #: For a backup copy: the node it came from ("" for a copy saved on this node).
    origin: str = ""
    #: Nodes holding a backup copy of this generation.
    replicas: set[str] = field(default_factory=set)
    #: Set when nodes of the redundancy group disagree on the content of this path.
    conflict: str = ""
    #: The tier that served the most recent load ("local", "peer", "storage").
    last_load_tier: str = ""
    #: Who saved it (uid, gid, umask); None when it came from a peer or from storage.
    saver: Saver | None = None
    #: For a staging copy (``commit_pinned``), the lease that holds it (0: not one): never
    #: announced, replicated, digested or persisted, and dropped when that lease goes (a
    #: load's lease on it, by another client, only unpins it).
    staged_by: int = 0
    digest_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def key(self) -> Key:
        """The (namespace, path) this generation belongs to."""
        return (self.namespace, self.path)


class Index:
    """Committed generations by (namespace, path), oldest first."""

    def __init__(self) -> None:
        self._objects: dict[Key, list[Generation]] = {}
        self._high_water: dict[Key, int] = {}

    def next_number(self, key: Key) -> int:
        """The generation number the next commit of ``key`` gets (never reused)."""
        return self._high_water.get(key, 0) + 1

    def add(self, generation: Generation) -> None:
        """Publish a committed generation."""
        gens = self._objects.setdefault(generation.key, [])
        gens.append(generation)
        gens.sort(key=lambda g: g.number)
        self._high_water[generation.key] = max(
            self._high_water.get(generation.key, 0), generation.number
        )

    def remove(self, generation: Generation) -> None:
        """Unpublish a generation (it stays alive while pinned)."""
        gens = self._objects.get(generation.key, [])
        if generation in gens:
            gens.remove(generation)
        if not gens:
            self._objects.pop(generation.key, None)

    def newest(self, key: Key) -> Generation | None:
        """The newest committed generation of ``key``."""
        gens = self._objects.get(key)
        return gens[-1] if gens else None

    def get(self, key: Key, number: int) -> Generation | None:
        """A specific generation of ``key``."""
        return next((g for g in self._objects.get(key, []) if g.number == number), None)

    def generations(self, key: Key) -> list[Generation]:
        """All generations of ``key``, oldest first."""
        return list(self._objects.get(key, []))

    def superseded(self, key: Key, keep: int) -> list[Generation]:
        """Generations beyond the ``keep`` newest of ``key``."""
        gens = self._objects.get(key, [])
        return list(gens[: max(0, len(gens) - keep)])

    def paths(self) -> list[Key]:
        """Every (namespace, path) with at least one generation."""
        return sorted(self._objects)

    def __iter__(self) -> Iterator[Generation]:
        for gens in self._objects.values():
            yield from gens
