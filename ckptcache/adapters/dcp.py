"""``torch.distributed.checkpoint`` (DCP): a cache-backed ``StorageWriter`` / ``StorageReader``.

::

    import ckptcache.adapters.dcp as cdcp
    cdcp.enable()                                     # plain dcp.save/load(checkpoint_id=dir)
    dcp.save(state_dict, checkpoint_id=ckpt_dir)      # now through the cache
    dcp.save(state_dict, storage_writer=cdcp.CacheWriter(ckpt_dir))        # or explicitly
    dcp.async_save(state_dict, storage_writer=cdcp.CacheWriter(ckpt_dir))  # stall = the memcpy
    dcp.load(state_dict, storage_reader=cdcp.CacheReader(ckpt_dir))        # was FileSystemReader

**Stock signatures.** ``CacheWriter`` subclasses ``FileSystemWriter`` and ``CacheReader``
``FileSystemReader``: every argument of the installed torch's classes is accepted (positional or
keyword), plus the keyword-only ``commit_waits`` and ``client``. Honoured: ``path``,
``single_file_per_rank`` and ``thread_count`` (the same files per rank as ``FileSystemWriter``:
one per item, or ``thread_count`` per rank), ``overwrite``, ``sync_files`` (for ``.metadata``;
the daemon always fsyncs what it persists), ``_extensions`` (each item is transformed as DCP
does, descriptors recorded) and the reader's ``_extension_registry``. Ignored:
``per_thread_copy_ahead`` and ``cache_staged_state_dict`` (staging is the cache's memcpy into a
reused segment, not DCP's CPU copy). ``serialization_format=SAFETENSORS`` raises
``ValueError``: the cache persists ``torch.save`` archives.

**On-disk format: a plain DCP checkpoint.** ``FileSystemWriter`` stores each tensor item as a
``torch.save`` archive of that tensor, and each bytes item raw, at ``(file, offset, length)``
recorded in ``.metadata``. The writer makes **one cached object per file** (one per rank by
default, as DCP writes one file per rank): a ``uint8`` tensor in which the items' archives lie
back to back (:class:`ckptcache.client.Packed`), copied straight into the cache's segment
(:meth:`ckptcache.Client.save_packed`: one copy of the bytes, no intermediate blob). The daemon
persists an object as exactly the ``torch.save`` archive of it, so the persisted
``__{rank}_0.distcp`` holds each item's archive at a known offset, and ``.metadata`` records
those offsets: ``FileSystemReader`` and every DCP tool read the persisted directory with no
ckptcache installed. Small tensors share one segment instead of taking one each.

**When the files exist (the contract).** ``.metadata`` is written by the coordinator in
``finish`` (DCP's own code, temp + rename), after every rank's ``write_data`` returned; a save
that fails in any phase never writes it and drops the objects it handed to the cache.
``commit_waits`` says what ``write_data`` waits for, hence what ``.metadata`` implies:

* ``"files"`` (default; ``$CKPTCACHE_COMMIT_WAITS`` changes it): every file exists on the file
  system, persisted by the daemon, or, under no persist root, written here once (temp +
  rename). DCP's own readers and tools (``FileSystemReader``, ``format_utils``) work right
  after ``dcp.save`` returns, as without the cache; the price is waiting for storage.
  With ``dcp.async_save`` that wait runs in DCP's background thread, off the training loop:
  the stall is the copy into the cache (``stage``), and the future completes once the files
  and ``.metadata`` are there.
* ``"persisted"``: every file is in storage (raises ``PathNotAllowed`` when no persist root
  covers the directory).
* ``"local"``: the items are in this node's memory. ``CacheReader`` (and ``dcp.load`` and
  ``format_utils`` after :func:`enable`) reads them at once; the files appear when the daemon
  has persisted them (:func:`ckptcache.wait`), never, for a directory under no persist root.

Call order (DCP drives it; see ``torch.distributed.checkpoint.storage``): writer ``reset`` ->
``set_up_storage_writer`` -> ``prepare_local_plan`` -> (coordinator) ``prepare_global_plan``
-> ``write_data`` -> (coordinator) ``finish``. With ``async_save`` the writer is also the
stager: ``stage`` runs first, in the caller's thread, and is the only stall.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    SerializationFormat,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import ckptcache
from ckptcache.adapters import _common
from ckptcache.client import BlobFile, Packed

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["CacheReader", "CacheWriter", "disable", "enable", "is_enabled"]

_SUFFIX = ".distcp"


def _item_tensor(data: torch.Tensor) -> torch.Tensor:
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        # A view of a larger storage: save only its bytes, as FileSystemWriter does.
        t = t.clone()
    return t


class CacheWriter(FileSystemWriter):  # type: ignore[misc]
    """A DCP ``StorageWriter`` whose files go to the cache (phase 1), persisted by the daemon.

    Takes every argument of ``FileSystemWriter`` (see the module docstring for what each does
    here) plus ``commit_waits`` (``"files"`` by default, ``"persisted"`` or ``"local"``) and
    ``client``
    (defaults to the process's default client). Also an ``AsyncStager`` (``stage``), so
    ``dcp.async_save`` stages through the cache instead of copying into CPU buffers first.
    """

    # AsyncStager protocol: staging is done when stage() returns.
    _synchronize_after_execute: bool = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        *args: Any,
        commit_waits: str | None = None,
        client: ckptcache.Client | None = None,
        **kwargs: Any,
    ):
        super().__init__(os.path.abspath(os.fspath(path)), *args, **kwargs)
        if self.serialization_format != SerializationFormat.TORCH_SAVE:
            raise ValueError(
                f"CacheWriter persists torch.save archives; serialization_format="
                f"{self.serialization_format} needs FileSystemWriter"
            )
        self.commit_waits = _common.resolve_commit_waits(commit_waits)
        self._client = client
        self._staged: list[ckptcache.Staged] = []
        self._rank_hint = 0

    @property
    def client(self) -> ckptcache.Client:
        """The client this writer saves through."""
        return _common.client_of(self._client)

    # ------------------------------------------------------------------ StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (optionally into another directory)."""
        super().reset(os.path.abspath(os.fspath(checkpoint_id)) if checkpoint_id else None)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember this rank (for the file names when DCP gives no prefix)."""
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self._rank_hint = int(rank or 0)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save each of this rank's files as one cached object; drop them all on failure."""
        prefix = plan.storage_data.prefix if plan.storage_data else f"__{self._rank_hint}_"
        saved: list[str] = []
        try:
            results = [
                result
                for i, items in enumerate(self._files(plan.items))
                for result in self._write_file(f"{prefix}{i}{_SUFFIX}", items, planner, saved)
            ]
            _common.settle(self._client, saved, self.commit_waits)
        except BaseException:
            self._discard(saved)
            raise
        finally:
            self._release_staged()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _files(self, items: list[WriteItem]) -> list[list[WriteItem]]:
        """Items per file, exactly as ``FileSystemWriter`` splits them."""
        if not items:
            return []
        if self.single_file_per_rank:
            return [b for b in _split_by_size_and_type(self.thread_count, items) if b]
        return [[item] for item in items]

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, saved: list[str]
    ) -> list[WriteResult]:
        payloads = [self._payload(item, planner) for item in items]
        packed = Packed([p for p, _ in payloads])
        path = os.path.join(os.fspath(self.path), name)
        # The items go straight into the cache's segment: one copy, no intermediate blob.
        base = self.client.save_packed(packed, path)
        saved.append(path)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=span.length,
                storage_data=_StorageInfo(name, base + span.offset, span.length, descriptors),
            )
            for item, span, (_, descriptors) in zip(items, packed.spans, payloads, strict=True)
        ]

    def _payload(
        self, item: WriteItem, planner: SavePlanner
    ) -> tuple[torch.Tensor | memoryview, list[str] | None]:
        """What goes into the file for ``item`` (as ``FileSystemWriter`` writes it)."""
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            raw: torch.Tensor | memoryview = data.getbuffer()
        else:
            raw = _item_tensor(cast(torch.Tensor, data))
        if not self.transforms.extensions:
            return raw, None
        # Extensions (compression, ...) transform the serialized stream, as in DCP.
        out = io.BytesIO()
        stream, descriptors = self.transforms.transform_save_stream(item, out)
        if isinstance(raw, torch.Tensor):
            torch.save(raw, stream)
        else:
            stream.write(raw)
        stream.close()
        return out.getbuffer(), descriptors or None

    def _discard(self, paths: list[str]) -> None:
        for p in paths:
            try:
                self.client.delete(p)
            except ckptcache.CkptCacheError:
                pass  # best effort: without .metadata the items are not a checkpoint anyway

    # ------------------------------------------------------------------ AsyncStager

    @property
    def should_synchronize_after_execute(self) -> bool:
        """``stage`` is synchronous: nothing to synchronize afterwards."""
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict``'s tensors into the cache (one memcpy) and return it over that
        copy (:meth:`ckptcache.Client.stage`).

        The returned state dict's tensors lie on this process's copy-on-write mapping of the
        daemon's copy: training may modify the originals at once, and DCP's background save
        then reads the staged copy. The copy is memory only, held by a lease (nothing evicts
        it meanwhile), and given back after ``write_data`` (or in :meth:`close`; the daemon
        drops it by itself if the process dies). Without a daemon it is a plain CPU copy.
        """
        tensors: list[torch.Tensor] = []
        skeleton = _strip_tensors(state_dict, tensors)
        staged = self.client.stage(tensors)
        self._staged.append(staged)
        return _restore_tensors(skeleton, staged.tensors)  # type: ignore[no-any-return]

    def synchronize_staging(self) -> None:
        """Nothing to do: ``stage`` returns when the copy is done."""

    def close(self) -> None:
        """Give back any staging copy still held."""
        self._release_staged()

    def _release_staged(self) -> None:
        staged, self._staged = self._staged, []
        for copy_ in staged:
            copy_.release()


# ---------------------------------------------------------------------- staging helpers


@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    index: int
    rebuild: Callable[[torch.Tensor], Any]


#: Immutable values a staged state dict may share with the live one (no deep copy needed).
_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})


def _strip_tensors(obj: Any, out: list[torch.Tensor]) -> Any:
    """Replace every tensor (a DTensor: its local shard) by a slot; collect them in ``out``."""
    from torch.distributed.tensor import DTensor

    return _strip(obj, out, DTensor)


def _strip(obj: Any, out: list[torch.Tensor], dtensor: type[DTensor]) -> Any:
    kind = type(obj)
    if kind in _ATOMS:  # most leaves of an optimizer's state: no deepcopy call per value
        return obj
    if isinstance(obj, dtensor):
        mesh, placements, shape, stride = obj.device_mesh, obj.placements, obj.shape, obj.stride()
        out.append(obj.to_local().detach())

        def rebuild(local: torch.Tensor) -> Any:
            return dtensor.from_local(local, mesh, placements, shape=shape, stride=stride)

        return _TensorSlot(len(out) - 1, rebuild)
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
        return _TensorSlot(len(out) - 1, _same)
    if isinstance(obj, dict):
        return kind((k, _strip(v, out, dtensor)) for k, v in obj.items())
    if kind in (list, tuple):
        return kind(_strip(v, out, dtensor) for v in obj)
    return copy.deepcopy(obj)  # small Python state: snapshot it like the tensors


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _restore_tensors(obj: Any, staged: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return obj.rebuild(staged[obj.index])
    if isinstance(obj, dict):
        return type(obj)((k, _restore_tensors(v, staged)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_restore_tensors(v, staged) for v in obj)
    return obj


# ---------------------------------------------------------------------- reader


class _CacheFileSystem(FileSystem):  # type: ignore[misc]
    """DCP's ``FileSystem``, except that files the local daemon holds are read from memory."""

    def __init__(self, reader: CacheReader):
        super().__init__()
        self._reader = reader

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        name = os.fspath(path)
        if mode != "rb" or not name.endswith(_SUFFIX):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        client = self._reader.client
        if not _common.in_memory(_common.cached_status(client, name)):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        obj = client.load(name)
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.uint8 and obj.dim() == 1:
            stream = BlobFile(obj)  # the part of the file DCP's items live in
        else:
            # One object per item (earlier CacheWriter versions): the file is its archive.
            stream = io.BytesIO()
            torch.save(obj, stream)
        with stream:
            yield cast(io.IOBase, stream)


class CacheReader(FileSystemReader):  # type: ignore[misc]
    """A DCP ``StorageReader`` that serves files from the cache, else from storage.

    Takes every argument of ``FileSystemReader`` (``_extension_registry`` included) plus
    ``client``. DCP's own reading code runs unchanged (slicing, extensions, resharding); only
    the bytes of a file the local daemon holds come from memory. Reads any DCP checkpoint:
    a ``FileSystemWriter`` checkpoint or an evicted object is read from the files.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *args: Any,
        client: ckptcache.Client | None = None,
        **kwargs: Any,
    ):
        super().__init__(os.path.abspath(os.fspath(path)), *args, **kwargs)
        self._client = client
        self.fs = _CacheFileSystem(self)

    @property
    def client(self) -> ckptcache.Client:
        """The client this reader loads through."""
        return _common.client_of(self._client)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load (optionally from another directory)."""
        super().reset(os.path.abspath(os.fspath(checkpoint_id)) if checkpoint_id else None)


# ---------------------------------------------------------------------- enable / disable

#: (module, name) -> the stock class that :func:`enable` replaced there.
_STOCK: dict[tuple[str, str], type] = {}
#: Where DCP builds its file-system classes by name: ``_storage_utils`` for a bare
#: ``checkpoint_id``, ``format_utils`` for ``dcp_to_torch_save``/``torch_save_to_dcp``.
_PATCHED_MODULES = (
    "torch.distributed.checkpoint._storage_utils",
    "torch.distributed.checkpoint.format_utils",
)


def enable(
    *, commit_waits: str | None = None, client: ckptcache.Client | None = None
) -> ckptcache.CacheStatus:
    """Make ``dcp.save``/``dcp.async_save``/``dcp.load`` called with only ``checkpoint_id=``
    (a local directory), and DCP's ``format_utils`` converters (``dcp_to_torch_save``,
    ``torch_save_to_dcp``), use :class:`CacheWriter` / :class:`CacheReader`; undone by
    :func:`disable`. Explicit ``storage_writer``/``storage_reader`` arguments are untouched.

    DCP picks its storage for a bare ``checkpoint_id`` from the classes it lists in
    ``torch.distributed.checkpoint._storage_utils`` (and ``format_utils`` builds
    ``FileSystemReader``/``Writer`` by name); this puts the cache's classes there, ahead of
    fsspec (which keeps URLs). ``commit_waits`` defaults as for :class:`CacheWriter`. Returns
    whether the cache is reachable, and logs it, so a missing daemon is visible at once
    (``CKPTCACHE_REQUIRE=1`` makes it an error).
    """
    if commit_waits is not None:
        _common.check_commit_waits(commit_waits)
    options = {"commit_waits": commit_waits, "client": client}

    class EnabledCacheWriter(CacheWriter):
        def __init__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any):
            super().__init__(path, *args, **{**options, **kwargs})

    class EnabledCacheReader(CacheReader):
        def __init__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any):
            super().__init__(path, *args, **{"client": client, **kwargs})

    replacements = {"FileSystemWriter": EnabledCacheWriter, "FileSystemReader": EnabledCacheReader}
    for module_name in _PATCHED_MODULES:
        module = importlib.import_module(module_name)
        for name, cls in replacements.items():
            _STOCK.setdefault((module_name, name), getattr(module, name))
            setattr(module, name, cls)
    return _common.report_enabled("DCP", client)


def disable() -> None:
    """Give ``checkpoint_id=``-only DCP calls and ``format_utils`` back to DCP's
    ``FileSystemWriter``/``Reader``."""
    for (module_name, name), cls in _STOCK.items():
        setattr(importlib.import_module(module_name), name, cls)
    _STOCK.clear()


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return bool(_STOCK)
