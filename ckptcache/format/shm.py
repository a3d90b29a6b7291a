"""Mapping daemon-owned segment files and moving tensor bytes in and out of them.

Two kinds of mapping, chosen for their cost profile:

* **write mappings** (``MAP_SHARED | MAP_POPULATE``) are made once per segment and kept by the
  client across saves: page tables stay populated, so a repeated save into a reused segment
  runs at memcpy speed instead of paying a page fault per 4 KiB.
* **load mappings** (``MAP_PRIVATE``) back zero-copy tensors: reads share the daemon's pages,
  while a write by the trainer faults in a private copy of that page. A trainer that updates a
  loaded tensor in place (an optimizer step) can therefore never corrupt the cached copy.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import weakref
from collections.abc import Callable

import torch

__all__ = [
    "Mapping",
    "copy_storage_into",
    "map_private",
    "map_shared",
    "storage_copy",
    "storage_view",
]


class Mapping(mmap.mmap):
    """An ``mmap`` that supports weak references (so a finalizer can see it unmapped)."""


def _open(path: str, writable: bool) -> int:
    return os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)


def map_shared(path: str, size: int, *, populate: bool = True) -> Mapping:
    """Map ``size`` bytes of ``path`` read-write and shared, pre-faulting the page tables."""
    fd = _open(path, True)
    try:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return Mapping(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def map_private(
    path: str,
    size: int,
    on_unmap: Callable[[], None] | None = None,
    *,
    hold_lock: bool = False,
) -> Mapping:
    """Map ``path`` copy-on-write; ``on_unmap`` runs once nothing references the mapping.

    ``hold_lock`` keeps a shared ``flock`` on the file for as long as the mapping lives (the
    kernel drops it if the process dies): the daemon never reuses a segment someone still
    maps (see ``ckptcache.server.arena.mapped_by_others``), whatever happened to the
    client's connection.
    """
    fd = _open(path, False)
    try:
        if hold_lock:
            fcntl.flock(fd, fcntl.LOCK_SH)
        # PROT_WRITE on a MAP_PRIVATE mapping of a read-only fd is allowed: writes stay private.
        mapping = Mapping(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    if hold_lock:
        weakref.finalize(mapping, os.close, fd)  # closing the fd releases the lock
    else:
        os.close(fd)
    if on_unmap is not None:
        weakref.finalize(mapping, on_unmap)
    return mapping


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def copy_storage_into(mapping: mmap.mmap, offset: int, storage: torch.UntypedStorage) -> None:
    """Copy a storage's bytes (CPU or device) to ``offset`` of ``mapping``."""
    nbytes = storage.nbytes()
    if nbytes == 0:
        return
    dst = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    dst.copy_(_bytes_of(storage))


def storage_view(mapping: mmap.mmap, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A storage backed by ``mapping`` itself (zero copy); it keeps the mapping alive."""
    if nbytes == 0:
        return torch.UntypedStorage(0)
    return torch.frombuffer(
        mapping, dtype=torch.uint8, count=nbytes, offset=offset
    ).untyped_storage()


def storage_copy(mapping: mmap.mmap, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A private heap copy of ``nbytes`` at ``offset`` (no reference to the mapping is kept)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        out.copy_(torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset))
    return out.untyped_storage()
