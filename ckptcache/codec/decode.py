"""The one decode entry: an object rebuilt from its stored pieces, by the fastest decoder that
applies.

The decoders, tried in this order; each one that does not apply, or gives up
(:data:`~ckptcache.codec.fast_unpickle.NOT_FAST`), hands the load to the next:

1. **The tensor table** (:mod:`ckptcache.codec.table.table`): a plain state dict saved with a
   table, loaded zero-copy to the CPU. Its tensors are made in bulk from columns, and its tree
   unpickled in the C unpickler with no Python call per tensor.
2. **The skeleton in the C unpickler** (:mod:`ckptcache.codec.fast_unpickle`): a
   ``weights_only`` load whose skeleton holds only the common containers and tensors.
3. **The unpickler** (:func:`ckptcache.codec.flatten.unpickle`): torch's weights-only
   unpickler, or pickle's with ``weights_only=False``; it reads every skeleton and raises the
   errors a load reports.

The first two do not run under a fake tensor mode (:func:`~ckptcache.codec.fast_unpickle.
fast_load_applies`). :func:`decode` reads an object from a mapping (a segment, or a stored
archive read into memory) and starts at 1; :func:`decode_skeleton` rebuilds a skeleton over
storages a caller holds already and starts at 2.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptcache.codec.fast_unpickle import NOT_FAST, ArrayLoader, fast_load_applies, fast_unpickle
from ckptcache.codec.flatten import MapLocation, StorageLoader, storage_loader, unpickle
from ckptcache.codec.gpu.copy import device_target, load_to_device
from ckptcache.codec.shm import storage_copy, storage_view
from ckptcache.codec.table.table import load_table
from ckptcache.errors import CorruptCheckpoint

__all__ = ["Stored", "decode", "decode_skeleton"]

#: Storage key -> ``(offset, nbytes)`` in the mapping.
Places = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class Stored:
    """An object as it lies in a mapping: what :func:`decode` rebuilds it from."""

    mapping: mmap.mmap
    skeleton: bytes
    #: Where each storage lies, made when a decoder needs it (the tensor table does not).
    places: Callable[[], Places]
    #: The path the object was saved under, and the tier it is read from (for errors).
    path: str
    tier: str
    #: The encoded tensor table (``""``: none) and its storages' offsets and sizes, in
    #: manifest order.
    table: str = ""
    extents: tuple[Any, Any] = ((), ())


def decode(
    stored: Stored,
    *,
    zero_copy: bool = True,
    weights_only: bool = True,
    map_location: MapLocation = None,
) -> Any:
    """Rebuild the object of ``stored``, trying the decoders in the module's order.

    With ``zero_copy`` the CPU storages are views of the mapping (which they keep alive);
    otherwise private copies. A ``map_location`` that names one CUDA device loads each
    storage there from the mapping, through page-locked staging buffers, with no CPU copy.
    """
    mapping = stored.mapping
    device = device_target(map_location)
    # One array over the whole mapping; each storage a slice of it: cheaper than
    # torch.frombuffer per storage, with the same result (a storage over the mapping's bytes
    # that keeps the mapping alive).
    whole = np.frombuffer(mapping, dtype=np.uint8) if zero_copy and device is None else None
    # The tensor table makes CPU tensors only: any other map_location (a device, a dict, a
    # callable, "meta") is applied to each storage as torch.load applies it.
    if stored.table and whole is not None and _on_cpu(map_location) and fast_load_applies():
        result = load_table(stored.table, whole, stored.extents)
        if result is not NOT_FAST:
            return result
    places = stored.places()
    to_device = None
    if device is not None:
        to_device = load_to_device(mapping, device, sum(n for _, n in places.values()))
    from_numpy = torch.from_numpy
    path, tier = stored.path, stored.tier

    def load_storage(key: str, nbytes: int) -> torch.UntypedStorage:
        offset, size = places.get(key, (0, -1))
        if size != nbytes:
            raise CorruptCheckpoint(
                f"skeleton of {path!r} refers to storage {key} that the {tier} copy does not "
                "hold", tier=tier,
            )  # fmt: skip
        if to_device is not None:  # host-to-device from the pinned mapping, no CPU copy
            return to_device.storage(offset, nbytes)
        if whole is not None and nbytes:
            if offset < 0 or offset + nbytes > len(whole):  # a slice would be cut short
                raise CorruptCheckpoint(f"storage {key} of {path!r} lies outside the {tier} copy",
                                        tier=tier)  # fmt: skip
            return from_numpy(whole[offset : offset + nbytes]).untyped_storage()
        if zero_copy:
            return storage_view(mapping, offset, nbytes)
        return storage_copy(mapping, offset, nbytes)

    def load_array(key: str, nbytes: int) -> np.ndarray | None:
        """Storage ``key``'s bytes as a slice of ``whole``, for a tensor made straight over
        them (None: the storage is made by ``load_storage``, with its errors)."""
        offset, size = places.get(key, (0, -1))
        if whole is None or size != nbytes or offset < 0 or offset + nbytes > len(whole):
            return None
        return whole[offset : offset + nbytes]

    try:
        return decode_skeleton(
            stored.skeleton, load_storage, weights_only=weights_only, map_location=map_location,
            load_array=load_array if whole is not None else None, placed=to_device is not None,
        )  # fmt: skip
    finally:
        if to_device is not None:
            to_device.finish()


def _on_cpu(map_location: MapLocation) -> bool:
    """Whether ``map_location`` leaves every storage on the CPU (none, or the CPU named)."""
    if map_location is None:
        return True
    if isinstance(map_location, (str, torch.device)):
        try:
            return torch.device(map_location) == torch.device("cpu")
        except (RuntimeError, TypeError, ValueError):  # torch.load says what is wrong
            return False
    return False


def decode_skeleton(
    skeleton: bytes | memoryview, load_storage: StorageLoader, *, weights_only: bool = True,
    map_location: MapLocation = None, load_array: ArrayLoader | None = None, placed: bool = False,
) -> Any:  # fmt: skip
    """Rebuild an object from its skeleton (the inverse of
    :func:`~ckptcache.codec.flatten.flatten`), trying the decoders from 2 of the module's
    order; ``load_storage(key, nbytes)`` returns CPU storages (``placed``: storages already
    where ``map_location`` puts them, left there).

    With ``weights_only=True`` only torch's allowlist plus
    :func:`~ckptcache.codec.flatten.extra_safe_globals` may be unpickled; anything else raises
    :class:`~ckptcache.errors.UnsafeUnpickle`. ``load_array(key, nbytes)`` (zero-copy loads)
    gives a storage's bytes as an array over the mapping, from which a tensor covering its
    whole storage is made directly.
    """
    persistent_load = storage_loader(load_storage, map_location, placed)
    if weights_only and fast_load_applies():
        result = fast_unpickle(
            skeleton, persistent_load, load_array if map_location is None else None
        )
        if result is not NOT_FAST:
            return result
        # Something beyond the common case (or damage): the unpickler decides, with the
        # storages already made.
    return unpickle(skeleton, persistent_load, weights_only=weights_only)
