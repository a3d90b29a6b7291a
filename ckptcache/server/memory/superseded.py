"""Saves that storage superseded: what ``status`` and ``wait`` say of them once they left memory.

A save whose persist finds a newer object on storage (a write by hand, a save written through
elsewhere, a newer save made on another node) is never written, and its memory is freed at
once. Without a record, ``status(path)`` would then describe the file on storage as
``persisted``, which is false for the save the user made. The record keeps the last such save
of each path, until a newer save of the path is committed here (a copy read back from storage
is not one), the user writes the path through, or the user deletes it.

Call order (all under the state lock): :meth:`SupersededSaves.remember` when a superseded
generation leaves the index, :meth:`SupersededSaves.forget` at a newer save's commit, a
write-through or a delete, :meth:`SupersededSaves.get` from ``stat`` and ``wait``.

Memory is bounded: at most :data:`LIMIT` paths are remembered, the oldest record first out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ckptcache.server.memory.index import Generation, Key
from ckptcache.server.ownership import Saver
from ckptcache.wire import messages as m
from ckptcache.wire.states import PersistState

__all__ = ["LIMIT", "SupersededSave", "SupersededSaves"]

#: Paths remembered at most (a record is a few hundred bytes).
LIMIT = 4096

_NEWER = "storage holds an object written after this save: that write is the newer one"


@dataclass(frozen=True)
class SupersededSave:
    """The last superseded save of one path, as ``status`` reports it."""

    #: Who saved it: ownership decides who may be told (see :func:`ownership.may_see`).
    saver: Saver | None
    info: m.ObjectInfo


class SupersededSaves:
    """The last superseded save of each path, at most :data:`LIMIT` of them."""

    def __init__(self, limit: int = LIMIT):
        self._limit = limit
        self._saves: OrderedDict[Key, SupersededSave] = OrderedDict()

    def remember(self, gen: Generation) -> None:
        """Record ``gen`` (superseded, about to leave memory) unless a newer generation of
        its path is already recorded."""
        old = self._saves.get(gen.key)
        if old is not None and old.info.generation > gen.number:
            return
        info = m.ObjectInfo(
            namespace=gen.namespace, path=gen.path, generation=gen.number, size=gen.size,
            stages=(), committed=gen.committed, segment="", pins=0, digests_valid=False,
            generations=0, persist_state=PersistState.SUPERSEDED,
            persist_error=gen.persist_error or _NEWER, origin=gen.origin,
        )  # fmt: skip
        self._saves[gen.key] = SupersededSave(gen.saver, info)
        self._saves.move_to_end(gen.key)
        while len(self._saves) > self._limit:
            self._saves.popitem(last=False)

    def forget(self, key: Key) -> None:
        """A newer save of ``key`` (or its write-through, or its delete) replaces the record."""
        self._saves.pop(key, None)

    def get(self, key: Key) -> SupersededSave | None:
        """The record of ``key``, if any."""
        return self._saves.get(key)

    def __len__(self) -> int:
        return len(self._saves)
