"""A tensor table's columns: the dense tensors as packed arrays.

Most tensors of a state dict alone cover their whole storage, contiguous from offset 0: for
those a load needs only the dtype, the shape and which storage, and the table writes them as
little-endian arrays that a load reads with ``np.frombuffer`` and checks with a few numpy
comparisons, instead of tuples unpickled and checked number by number. The other tensors
(views, tied weights, offsets, empty ones) follow as pickled columns, and the tree after
them. The layout, after the table's base64::

    magic (8 bytes) | n_dense, n_dims, strided_size (3 x uint64)
    | storage index (int64 x n_dense) | dims (int64 x n_dims)
    | dtype code, ndim, requires_grad (uint8 x n_dense each)
    | strided columns (pickle, strided_size bytes) | tree (pickle)

The magic names the layout: a table without it is not read (the load takes the skeleton's
path), and a layout change takes a new magic.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "CODES",
    "MAGIC",
    "Dense",
    "contiguous_strides",
    "dense_places",
    "pack_dense",
    "unpack_dense",
]

MAGIC = b"\xffckptT2\x00"
_HEAD = struct.Struct("<QQQ")
#: The table's dtype codes (an append-only list: a code names its dtype for good).
CODES: tuple[torch.dtype, ...] = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_CODE_OF = {d: i for i, d in enumerate(CODES)}


class Dense(NamedTuple):
    """The dense tensors' columns as read (unchecked beyond their lengths)."""

    storage: np.ndarray
    dims: np.ndarray
    code: np.ndarray
    ndim: np.ndarray
    requires_grad: np.ndarray


def dense_places(columns: Sequence[Any]) -> list[bool]:
    """Per tensor of the plan cache's ``columns``, whether it alone covers its whole,
    non-empty storage, contiguous from offset 0 (what the table packs)."""
    dtypes, shapes, strides, offsets, indices, _, _, storage_sizes = columns
    uses: dict[int, int] = {}
    for index in indices:
        uses[index] = uses.get(index, 0) + 1
    return [
        offset == 0
        and uses[index] == 1
        and 0 < storage_sizes[index] == dtype.itemsize * math.prod(shape)
        and tuple(stride) == contiguous_strides(tuple(shape))
        for dtype, shape, stride, offset, index in zip(
            dtypes, shapes, strides, offsets, indices, strict=True
        )
    ]


def pack_dense(columns: Sequence[Any], dense: Sequence[bool], strided_size: int) -> bytes:
    """The table's head and packed arrays for the tensors marked ``dense`` (in order), to be
    followed by ``strided_size`` bytes of strided columns and the tree."""
    dtypes, shapes, _, _, indices, requires_grad, _, _ = columns
    picked = [i for i, d in enumerate(dense) if d]
    dims = [size for i in picked for size in shapes[i]]
    return b"".join((
        MAGIC, _HEAD.pack(len(picked), len(dims), strided_size),
        np.array([indices[i] for i in picked], dtype="<i8").tobytes(),
        np.array(dims, dtype="<i8").tobytes(),
        bytes(_CODE_OF[dtypes[i]] for i in picked),
        bytes(len(shapes[i]) for i in picked),
        bytes(bool(requires_grad[i]) for i in picked),
    ))  # fmt: skip


def unpack_dense(blob: memoryview) -> tuple[Dense, memoryview, memoryview]:
    """The dense columns of a table's bytes, its strided columns' bytes and its
    tree's bytes. Raises ``ValueError`` where the lengths do not add up."""
    n_dense, n_dims, strided_size = _HEAD.unpack_from(blob, len(MAGIC))
    at = len(MAGIC) + _HEAD.size
    end = at + 8 * (n_dense + n_dims) + 3 * n_dense + strided_size
    if end > len(blob):
        raise ValueError("a tensor table cut short")
    index = np.frombuffer(blob, "<i8", n_dense, at)
    dims = np.frombuffer(blob, "<i8", n_dims, at + 8 * n_dense)
    at += 8 * (n_dense + n_dims)
    code, ndim, grad = (np.frombuffer(blob, np.uint8, n_dense, at + k * n_dense) for k in range(3))
    at += 3 * n_dense
    return Dense(index, dims, code, ndim, grad), blob[at : at + strided_size], blob[end:]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch gives them: a dimension of
    size 1 or 0 still gets the product of the sizes after it)."""
    strides, expected = [], 1
    for size in reversed(shape):
        strides.append(expected)
        expected *= max(size, 1)
    return tuple(reversed(strides))
