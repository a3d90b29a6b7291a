"""The client's shared mappings of the daemon's segments, made once and reused by every later
save into the same segment (a save into a mapped segment pays no page faults), and what is
written into one beyond ``write_object``: a packed blob, and the read-back of a save."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ckptcache.client._connection import Connection
from ckptcache.wire import messages as m

if TYPE_CHECKING:
    from ckptcache.codec.packing import Packed
    from ckptcache.codec.shm import Mapping
    from ckptcache.format.manifest import ObjectPlan

__all__ = ["WriteMaps", "read_back", "write_packed"]


class WriteMaps:
    """Segment name -> this process's shared mapping of it; guarded by the connection's lock.

    It is also the port the spare mapper (:mod:`ckptcache.client._spares`) works through:
    :attr:`lock`, :attr:`pid`, :meth:`pool`, :meth:`seg_path`, ``in`` and :meth:`keep`.
    """

    def __init__(self, connection: Connection):
        self._connection = connection
        self._maps: dict[str, Mapping] = {}
        #: Cached mappings whose page tables are not all made yet (a spare whose mapping a
        #: save stopped): the save that gets one makes the rest on its copy threads.
        self._unpopulated: set[str] = set()

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The connection's lock: saves, the spare thread and ``close`` take it."""
        return self._connection.lock

    @property
    def pid(self) -> int:
        """The process the connection (and so these mappings) belongs to."""
        return self._connection.pid

    def pool(self) -> m.PoolReply:
        """The daemon's spare segments (a request: take :attr:`lock` first)."""
        return self._connection.call("pool", m.PoolRequest(), m.PoolReply)  # type: ignore[no-any-return]

    def seg_path(self, name: str) -> str:
        """The file of segment ``name``."""
        return self._connection.seg_path(name)

    def __contains__(self, name: object) -> bool:
        return name in self._maps

    def keep(self, name: str, mapping: Mapping, *, populated: bool = True) -> None:
        """Cache ``mapping`` of ``name`` unless one is cached already (then it is closed);
        ``populated``: whether all its page tables were made (else :meth:`get` makes them)."""
        if self._maps.setdefault(name, mapping) is not mapping:
            mapping.close()
        elif not populated:
            self._unpopulated.add(name)

    def get(self, segment: str, capacity: int) -> Mapping:
        """The cached mapping of ``segment`` (made if there is none, or too short: a spare
        trimmed by the daemon after we mapped it is shorter than our mapping)."""
        from ckptcache.codec.shm import map_shared, populate_in_parallel

        mapping = self._maps.get(segment)
        if mapping is None or len(mapping) < capacity:
            if mapping is not None:  # a registration must end before its pages go
                self._unmap(mapping, quiet=True)
            # A save waits for this mapping: its page tables are made by every copy thread.
            mapping = map_shared(self.seg_path(segment), capacity, parallel=True)
            self._maps[segment] = mapping
            self._unpopulated.discard(segment)
        elif segment in self._unpopulated:
            # The rest of a spare's page tables (the ones made already cost little again).
            populate_in_parallel(mapping)
            self._unpopulated.discard(segment)
        return mapping

    def drop_stale(self) -> None:
        """Free the mappings of segments the daemon dropped (their pages are ours too)."""
        for name in [n for n in self._maps if not os.path.exists(self.seg_path(n))]:
            self._unpopulated.discard(name)
            self._unmap(self._maps.pop(name))

    def close(self) -> None:
        """Unmap everything (a mapping still exported to a tensor stays until it goes)."""
        for mapping in list(self._maps.values()):
            try:
                self._unmap(mapping)
            except BufferError:
                pass
        self._maps, self._unpopulated = {}, set()

    def disown(self) -> None:
        """Forked: the parent's mappings are not ours to unpin or close."""
        self._maps, self._unpopulated = {}, set()

    @staticmethod
    def _unmap(mapping: Mapping, *, quiet: bool = False) -> None:
        """Unregister, then unmap ``mapping``; ``quiet``: one still exported to a tensor stays
        mapped until it goes."""
        from ckptcache.codec.gpu.pinning import unpin  # torch is loaded: segments were mapped

        unpin(mapping)
        try:
            mapping.close()
        except BufferError:
            if not quiet:
                raise


def read_back(mapping: Mapping, plan: ObjectPlan) -> Any:
    """The object a save copied into ``mapping`` (per ``plan``), as private copies.

    A non-blocking save releases the trainer once its copy is done, before the commit, so
    that the commit's round trip (and any replication) overlaps training: if the commit then
    fails, the live tensors may hold the next step already, and only the segment still holds
    what was saved. Reading it back costs a second copy, on this rare path alone."""
    from ckptcache.codec.objectio import read_object

    return read_object(
        mapping, plan.layout.manifest_offset, len(plan.manifest_bytes),
        zero_copy=False, weights_only=False,
    )  # fmt: skip


def write_packed(mapping: Mapping, plan: ObjectPlan, packed: Packed) -> None:
    """``write_object`` for an object whose one storage is ``packed``'s blob: the archive's
    metadata and the manifest as usual, then the items straight into the storage's place."""
    import torch

    from ckptcache.codec.objectio import write_metadata

    write_metadata(mapping, plan)
    (record,) = plan.manifest.storages
    if record.nbytes:
        packed.fill(torch.frombuffer(mapping, dtype=torch.uint8, count=record.nbytes,
                                     offset=record.offset))  # fmt: skip
