"""``torch.distributed.checkpoint`` (DCP): a cache-backed ``StorageWriter`` / ``StorageReader``.

::

    import ckptcache.adapters.dcp as cdcp
    dcp.save(state_dict, storage_writer=cdcp.CacheWriter(ckpt_dir))        # was FileSystemWriter
    dcp.async_save(state_dict, storage_writer=cdcp.CacheWriter(ckpt_dir))  # stall = the memcpy
    dcp.load(state_dict, storage_reader=cdcp.CacheReader(ckpt_dir))        # was FileSystemReader

On-disk format (why it stays a plain DCP checkpoint): ``FileSystemWriter`` stores each tensor
item as a ``torch.save`` archive of that tensor and each bytes item as the raw ``torch.save``
bytes the planner produced, at ``(relative_path, offset, length)`` recorded in ``.metadata``.
The cache persists every object as exactly the ``torch.save`` archive of that object, so the
writer makes **one cached object per write item**, named ``__{rank}_{i}.distcp`` — the names
``FileSystemWriter(single_file_per_rank=False)`` uses — and records ``offset=0`` and the
archive's length. The persisted directory is then a normal DCP checkpoint that
``FileSystemReader`` (and every DCP tool) loads with no ckptcache installed; no second format
and no repacking step exist. The price is one cache object per tensor rather than per rank.

``.metadata`` is a pickle, not a ``torch.save`` archive, so it cannot be a cached object: the
coordinator writes it in ``finish`` with temp + fsync + rename, exactly as DCP does. It is the
commit marker: a save that fails in any phase never writes it, and drops the items it had
handed to the cache. ``commit_waits="persisted"`` makes every rank's ``write_data`` wait until
its items are persisted, so ``.metadata`` appears only once the whole checkpoint is in storage
(with ``async_save`` that wait runs in DCP's background thread, off the training loop).

Call order (DCP drives it; see ``torch.distributed.checkpoint.storage``): writer ``reset`` ->
``set_up_storage_writer`` -> ``prepare_local_plan`` -> (coordinator) ``prepare_global_plan``
-> ``write_data`` -> (coordinator) ``finish``. With ``async_save`` the writer is also the
stager: ``stage`` runs first, in the caller's thread, and is the only stall.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import tempfile
import uuid
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemReader,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

import ckptcache
from ckptcache.adapters import _common

__all__ = ["CacheReader", "CacheWriter"]

_METADATA = ".metadata"
_SUFFIX = ".distcp"


@dataclasses.dataclass(frozen=True)
class _RankPrefix:
    """Global-plan storage data: the file-name prefix of one rank's items."""

    prefix: str


def _item_tensor(data: torch.Tensor) -> torch.Tensor:
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        # A view of a larger storage: save only its bytes, as FileSystemWriter does.
        t = t.clone()
    return t


class CacheWriter(StorageWriter):
    """A DCP ``StorageWriter`` whose items go to the cache (phase 1), persisted by the daemon.

    ``path``: the checkpoint directory (same as ``FileSystemWriter``'s). ``commit_waits``:
    ``"local"`` (default) or ``"persisted"`` (see the module docstring). ``client``: defaults to
    the process's default client. Also an ``AsyncStager`` (``stage``), so ``dcp.async_save``
    stages through the cache instead of copying into pinned buffers first.
    """

    # AsyncStager protocol: staging is done when stage() returns.
    _synchronize_after_execute: bool = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        commit_waits: str = "local",
        client: ckptcache.Client | None = None,
    ):
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.commit_waits = _common.check_commit_waits(commit_waits)
        self._client = client
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = False
        self._staged: list[str] = []

    @property
    def client(self) -> ckptcache.Client:
        """The client this writer saves through."""
        return _common.client_of(self._client)

    # ------------------------------------------------------------------ StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (optionally into another directory)."""
        if checkpoint_id:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember this rank's role."""
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = int(rank or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Create the directory (the daemon persists into it; ``.metadata`` goes there)."""
        os.makedirs(self.path, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give rank ``i``'s items the prefix ``__{i}_``, as ``FileSystemWriter`` does."""
        return [
            dataclasses.replace(p, storage_data=_RankPrefix(f"__{i}_"))
            if p.storage_data is None
            else p
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save every item of this rank as its own cached object; drop them all on failure."""
        prefix = plan.storage_data.prefix if plan.storage_data else f"__{self.rank}_"
        saved: list[str] = []
        try:
            results = [
                self._write_item(item, planner, f"{prefix}{i}{_SUFFIX}", saved)
                for i, item in enumerate(plan.items)
            ]
            if self.commit_waits == "persisted":
                for p in saved:
                    _common.wait_persisted(self._client, p)
        except BaseException:
            self._discard(saved)
            raise
        finally:
            self._release_staged()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_item(
        self, item: WriteItem, planner: SavePlanner, name: str, saved: list[str]
    ) -> WriteResult:
        path = os.path.join(self.path, name)
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            # DCP's bytes items are torch.save output (DefaultSavePlanner); caching the object
            # makes the persisted file that same archive, which load_bytes torch.loads.
            assert isinstance(data, io.BytesIO)
            data.seek(0)
            obj: Any = torch.load(data, weights_only=False)
        else:
            obj = _item_tensor(cast(torch.Tensor, data))
        self.client.save(obj, path)
        saved.append(path)
        size = self.client.status(path).size
        return WriteResult(
            index=item.index, size_in_bytes=size, storage_data=_StorageInfo(name, 0, size)
        )

    def _discard(self, paths: list[str]) -> None:
        for p in paths:
            try:
                self.client.delete(p)
            except ckptcache.CkptCacheError:
                pass  # best effort: without .metadata the items are not a checkpoint anyway

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` atomically (the commit point), as ``FileSystemWriter`` does."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        _common.atomic_write(os.path.join(self.path, _METADATA), lambda f: pickle.dump(metadata, f))

    def storage_meta(self) -> StorageMeta | None:
        """Checkpoint id and save id, recorded in ``.metadata``."""
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Local directories only (``.metadata`` is written with ``open``)."""
        return "://" not in os.fspath(checkpoint_id)

    # ------------------------------------------------------------------ AsyncStager

    @property
    def should_synchronize_after_execute(self) -> bool:
        """``stage`` is synchronous: nothing to synchronize afterwards."""
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the cache (one memcpy) and return a view of that copy.

        The returned state dict is backed by the daemon's segment (copy-on-write), so training
        may modify the originals at once; DCP's background save then reads the staged copy.
        The staging object is named under the temp directory, outside the checkpoint directory
        (and so outside any persist root that covers it), and is dropped after ``write_data``.
        """
        tensors: list[torch.Tensor] = []
        skeleton = _strip_tensors(state_dict, tensors)
        staging = os.path.join(
            tempfile.gettempdir(), f"ckptcache-dcp-staging-{os.getpid()}-{uuid.uuid4().hex}.pt"
        )
        self.client.save(tensors, staging)
        self._staged.append(staging)
        staged = self.client.load(staging, mmap=True)
        return _restore_tensors(skeleton, staged)

    def synchronize_staging(self) -> None:
        """Nothing to do: ``stage`` returns when the copy is done."""

    def close(self) -> None:
        """Drop any staging copy still held."""
        self._release_staged()

    def _release_staged(self) -> None:
        staged, self._staged = self._staged, []
        self._discard(staged)
        for p in staged:
            if os.path.exists(p):  # written through (no daemon): not part of the checkpoint
                os.unlink(p)


# ---------------------------------------------------------------------- staging helpers


@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    index: int
    rebuild: Callable[[torch.Tensor], Any]


def _strip_tensors(obj: Any, out: list[torch.Tensor]) -> Any:
    """Replace every tensor (a DTensor: its local shard) by a slot; collect them in ``out``."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        mesh, placements, shape, stride = obj.device_mesh, obj.placements, obj.shape, obj.stride()
        out.append(obj.to_local().detach())

        def rebuild(local: torch.Tensor) -> Any:
            return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)

        return _TensorSlot(len(out) - 1, rebuild)
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
        return _TensorSlot(len(out) - 1, lambda t: t)
    if isinstance(obj, dict):
        return type(obj)((k, _strip_tensors(v, out)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_strip_tensors(v, out) for v in obj)
    return copy.deepcopy(obj)  # small Python state: snapshot it like the tensors


def _restore_tensors(obj: Any, staged: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return obj.rebuild(staged[obj.index])
    if isinstance(obj, dict):
        return type(obj)((k, _restore_tensors(v, staged)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_restore_tensors(v, staged) for v in obj)
    return obj


# ---------------------------------------------------------------------- reader


class CacheReader(FileSystemReader):  # type: ignore[misc]
    """A DCP ``StorageReader`` that serves items from the cache, else from the files.

    Reads any DCP checkpoint: items written by :class:`CacheWriter` come from memory while the
    local daemon holds them, everything else (a ``FileSystemWriter`` checkpoint, packed files
    with offsets, an evicted object) through ``FileSystemReader``'s own code. Resharding works
    as in DCP: the planner decides which slices each rank reads.
    """

    def __init__(self, path: str | os.PathLike[str], *, client: ckptcache.Client | None = None):
        super().__init__(os.path.abspath(os.fspath(path)))
        self._client = client

    @property
    def client(self) -> ckptcache.Client:
        """The client this reader loads through."""
        return _common.client_of(self._client)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy every requested slice into the planner's tensors (cache first)."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        from_files: list[ReadItem] = []
        for relative_path, items in per_file.items():
            path = os.path.join(os.fspath(self.path), relative_path)
            whole = all(self.storage_data[i.storage_index].offset == 0 for i in items)
            if whole and _common.in_memory(_common.cached_status(self.client, path)):
                self._read_cached(path, items, planner)
            else:
                from_files.extend(items)
        if from_files:
            return super().read_data(dataclasses.replace(plan, items=from_files), planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_cached(self, path: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        # One item per file (CacheWriter); bytes items hold arbitrary objects, as in DCP.
        is_bytes = items[0].type == LoadItemType.BYTE_IO
        obj = self.client.load(path, weights_only=not is_bytes)
        for item in items:
            if item.type != LoadItemType.BYTE_IO:
                src = narrow_tensor_by_index(obj, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != src.size():
                    raise ValueError(
                        f"{item.storage_index}: checkpoint slice {tuple(src.size())} does not "
                        f"match the target {tuple(target.size())}"
                    )
                target.copy_(src)
                planner.commit_tensor(item, target)
            else:
                buf = io.BytesIO()
                torch.save(obj, buf)  # load_bytes expects torch.save bytes, as in the file
                buf.seek(0)
                planner.load_bytes(item, buf)
