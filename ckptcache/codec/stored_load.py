"""Loading a checkpoint from storage: read (or map) the stored object once, checked as it
arrives, then build the object over those bytes.

This builds on :mod:`ckptcache.format.persisted` (the persisted form and its checks) and
:mod:`ckptcache.format.archive_read` (ranged, hashed reads into memory); neither of those
knows about loading.
"""

from __future__ import annotations

import contextlib
import io
import mmap as mmap_module
import zipfile
from typing import Any

from ckptcache.format.archive_read import read_archive
from ckptcache.format.persisted import (
    check_archive,
    check_stored,
    storage_corrupt,
    stored_view,
    zip_marks,
)
from ckptcache.storage import StorageBackend, backend_for

__all__ = ["load_from_storage", "read_verified"]

#: Threads reading one object's ranges.
_READERS = 4
_ANONYMOUS = mmap_module.MAP_PRIVATE | mmap_module.MAP_ANONYMOUS


def load_from_storage(
    path: str,
    map_location: Any = None,
    *,
    weights_only: bool = True,
    mmap: bool | None = None,
    verify: bool = True,
) -> Any:
    """Load a stored checkpoint as ``torch.load`` would; damage raises
    :class:`CorruptCheckpoint` naming ``path``, the storage tier and the tensor.

    ``verify`` (the default): every record is checked against the digest record (or its
    CRC-32) and the zip structure against its digest while the file is read into memory
    (:func:`read_verified`: one pass), then the object is built over those bytes without
    another copy (``mmap=True``: over a private mapping of the file, which the check reads
    through). ``verify=False`` checks the structure only (truncation), then ``torch.load``.
    """
    if verify:
        mapping = read_verified(path, mapped=mmap is True)
        if mapping is not None:
            from ckptcache.codec.objectio import read_archive_object  # torch: client side only

            return read_archive_object(
                mapping, path=path, weights_only=weights_only, map_location=map_location
            )
    return _torch_load(path, map_location, weights_only, mmap)


def _torch_load(path: str, map_location: Any, weights_only: bool, mmap: bool | None) -> Any:
    """``torch.load`` after the structural check (and for files that are no zip archive)."""
    import torch

    with stored_view(path) as (view, data):
        check_stored(view, path, False)
        zipped = bytes(view[:4]) == b"PK\x03\x04"
    source: Any = path if data is None else io.BytesIO(data)
    # torch maps zip archives only: a legacy file (no zip) is read whatever ``mmap`` asks.
    kwargs: dict[str, Any] = {"mmap": mmap} if data is None and zipped else {}
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only, **kwargs)
    except (EOFError, zipfile.BadZipFile) as e:
        raise storage_corrupt(path, f"{type(e).__name__}: {e}") from e


def read_verified(path: str, *, mapped: bool = False) -> mmap_module.mmap | None:
    """The object stored at ``path`` in this process's memory, checked as
    :func:`check_archive` with ``deep`` checks it, the hashing done as the bytes arrive: ranged
    reads on a few threads into private anonymous memory
    (:func:`~ckptcache.format.archive_read.read_archive`), or with ``mapped`` (a local file) a
    private mapping of the file whose pages the check itself reads in. None when the object is
    no zip archive (a legacy ``torch.save`` file: nothing to check it against).

    Raises :class:`CorruptCheckpoint` for any damage, ``FileNotFoundError`` if it is absent.
    """
    backend = backend_for(path)
    size = backend.size(path)
    if size == 0:
        raise storage_corrupt(path, "the file is empty")
    if not _is_zip(backend, path, size):
        return None
    if mapped and "://" not in path:
        return _mapped_verified(path, size)
    mapping = _private_memory(size)
    view = memoryview(mapping)
    try:
        read_archive(backend, path, view, concurrency=_READERS, advance=_ignore)
    finally:
        view.release()
    return mapping


def _ignore(_: int) -> None:
    """Progress of a read nobody relays."""


def _private_memory(size: int) -> mmap_module.mmap:
    """Anonymous, private, writable memory for ``size`` bytes: the loaded tensors' storage.

    Asked for in 2 MiB pages where the kernel offers them on request (transparent huge pages
    in ``madvise`` mode, the usual default): a fresh buffer is faulted in as the reads land,
    and 4 KiB pages cost one fault each, most of the time of a load from a page-cached
    file. Unlike a
    save, a load from storage is no stall of training's steps, so the compaction a huge
    page may cost is acceptable here."""
    mapping = mmap_module.mmap(-1, size, flags=_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # no THP: 4 KiB pages, still correct
        mapping.madvise(mmap_module.MADV_HUGEPAGE)
    return mapping


def _mapped_verified(path: str, size: int) -> mmap_module.mmap:
    """A private (copy-on-write) mapping of the local file ``path``, checked through."""
    with open(path, "rb") as f:
        mapping = mmap_module.mmap(f.fileno(), size, flags=mmap_module.MAP_PRIVATE,
                                   prot=mmap_module.PROT_READ | mmap_module.PROT_WRITE)  # fmt: skip
    view = memoryview(mapping)
    try:
        check_archive(view, path, deep=True)
    finally:
        view.release()
    return mapping


def _is_zip(backend: StorageBackend, path: str, size: int) -> bool:
    """Whether the object is a zip archive (``torch.save``'s format since torch 1.6): it
    starts with a local header or ends with an end-of-central-directory record. Either may be
    damaged, so one of the two is enough; a legacy pickle file has neither."""
    head = bytearray(min(size, 4))
    backend.read_into(path, 0, memoryview(head))
    tail = bytearray(min(size, 22))
    backend.read_into(path, size - len(tail), memoryview(tail))
    return zip_marks(bytes(head), bytes(tail))
