"""A first save's skeleton written from the plan cache's walk, without the pickler.

:func:`~ckptcache.codec.flatten.flatten` pickles the object with a pickler whose
``reducer_override`` and ``persistent_id`` run in Python for every tensor and storage: a
third of the planning of a first save of thousands of tensors. For an object made of the
common containers and values and plain dense CPU tensors (what the plan cache's walk calls
*plain*), this module writes the same bytes directly: protocol 2, the same opcodes, the same
memo numbering, the same persistent ids (``("storage", <Storage class>, "<key>", "cpu",
numel)``) and the same ``_rebuild_tensor_v2`` records, byte for byte.

Why it can: the C pickler's output for these types is a function of the values and of object
identity alone. Every object it memoizes (``str``, ``tuple``, ``list``, ``dict``,
``OrderedDict``, tensors, classes, each persistent id, each tensor's argument tuple, its empty
hooks ``OrderedDict``) takes the next memo index, and a second reference to the same object
(by ``id``) is a ``BINGET``. The encoder keeps the same table, with the same objects the
pickler would see (the storage keys are made as ``flatten`` makes them, the location string
is the one ``torch.serialization.location_tag`` returns), so shared strings, tuples, tensors
and containers are written as the pickler writes them.

Anything outside that set (``bytes``, subclasses, other objects, a recursive tuple) makes
:func:`encode_skeleton` return ``None``: the caller pickles as before. The tests compare both
on random structures (``tests/codec/test_skeleton.py``).
"""

from __future__ import annotations

import collections
import functools
import pickle
import struct
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ckptcache.codec.flatten import PICKLE_PROTOCOL, Flattened, StorageInfo, tensor_names

__all__ = ["encode_flattened", "encode_skeleton"]

_Tensor = torch.Tensor
_OrderedDict = collections.OrderedDict
#: The pickler's batch size for ``APPENDS`` and ``SETITEMS``.
_BATCH = 1000
_LONG = struct.Struct("<I")
_FLOAT = struct.Struct(">d")
#: The persistent id's tag, the very object ``flatten`` writes (an interned constant).
_STORAGE_TAG = sys.intern("storage")


class _Unsupported(Exception):
    """A value the encoder does not write: the caller pickles instead."""


def _global(value: Any) -> bytes:
    """The ``GLOBAL`` record protocol 2 writes for a class or function (without its memo)."""
    pickled = pickle.dumps(value, protocol=PICKLE_PROTOCOL)
    # b"\x80\x02" GLOBAL ... BINPUT 0 STOP
    assert pickled.endswith(b"q\x00.")
    return pickled[2:-3]


@functools.cache
def _storage_classes() -> dict[torch.dtype, Any]:
    """Per dtype, the legacy storage class its tensors' storages are pickled as
    (``torch.FloatStorage`` for ``float32``: what ``flatten``'s persistent id names)."""
    classes: dict[torch.dtype, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy classes' ``dtype`` warns of deprecation
        for name in dir(torch):
            value = getattr(torch, name)
            if (
                name.endswith("Storage")
                and isinstance(value, type)
                and isinstance(dtype := getattr(value, "dtype", None), torch.dtype)
            ):
                classes.setdefault(dtype, value)
    return classes


def _int(value: int) -> bytes:
    """An ``int`` as protocol 2 writes it."""
    if 0 <= value < 256:
        return b"K" + bytes((value,))
    if 0 <= value < 65536:
        return b"M" + value.to_bytes(2, "little")
    if -2147483648 <= value <= 2147483647:
        return b"J" + value.to_bytes(4, "little", signed=True)
    encoded = pickle.encode_long(value)  # type: ignore[attr-defined]
    if len(encoded) < 256:
        return b"\x8a" + bytes((len(encoded),)) + encoded
    return b"\x8b" + len(encoded).to_bytes(4, "little", signed=True) + encoded


#: ``BINPUT i`` for the first 256 memo indices.
_SHORT_PUTS = tuple(b"q" + bytes((i,)) for i in range(256))


def _put(index: int) -> bytes:
    return _SHORT_PUTS[index] if index < 256 else b"r" + _LONG.pack(index)


def _get(index: int) -> bytes:
    return b"h" + bytes((index,)) if index < 256 else b"j" + _LONG.pack(index)


def _key_body(key: str) -> bytes:
    """A storage key's ``BINUNICODE`` length and bytes (decimal digits: ASCII)."""
    return _LONG.pack(len(key)) + key.encode("ascii")


def _tuple_body(values: Sequence[int]) -> bytes:
    """A tuple of ints without its memo record (``()`` has none: ``EMPTY_TUPLE``)."""
    n = len(values)
    items = b"".join(map(_int, values))
    if n == 0:
        return b")"
    if n <= 3:
        return items + b"\x85\x86\x87"[n - 1 : n]
    return b"(" + items + b"t"


def encode_skeleton(
    obj: Any,
    tensors: Sequence[torch.Tensor],
    columns: Sequence[Any],
    location: str,
) -> bytes | None:
    """``flatten(obj).skeleton``, written without the pickler, or ``None`` where ``obj``
    holds a value this module does not write (see the module docstring).

    ``tensors`` and ``columns`` are the plan cache's walk of ``obj`` (every tensor once, in
    pickling order, and their columns; all on the CPU); ``location`` is the storages'
    location tag, the string object ``torch.serialization.location_tag`` returns for them.
    """
    if any(device != -1 for device in columns[6]):
        return None
    encoder = _Encoder(tensors, columns, location)
    try:
        encoder.save(obj)
    except (_Unsupported, RecursionError, UnicodeEncodeError):
        return None
    finally:
        # The memo names objects by id(): what it holds stays alive only while in use.
        encoder.keep.clear()
        encoder.memo.clear()
    if encoder.next_tensor != len(tensors):
        return None
    encoder.write(b".")
    return b"".join(encoder.out)


class _Encoder:
    """One skeleton being written: the output, the pickler's memo, the tensors' columns."""

    def __init__(self, tensors: Sequence[torch.Tensor], columns: Sequence[Any], location: str):
        self.tensors = tensors
        self.columns = columns
        self.location = location
        self.out: list[bytes] = [b"\x80\x02"]
        self.write = self.out.append
        self.memo: dict[int, int] = {}  # id() of an object the pickler memoizes -> its index
        self.keep: list[Any] = []  # what ``memo`` names by id() stays alive while in use
        self.count = 0  # the memo's size: the index the next memoized object takes
        self.keys: list[str] = []  # the storage keys, made as ``flatten`` makes them
        self.shape_bodies: dict[tuple[int, ...], bytes] = {}
        self.next_tensor = 0
        self.classes = _storage_classes()
        #: Once the first tensor is written: the memo references of the records every
        #: tensor repeats (``_rebuild_tensor_v2``, the persistent id's tag and location,
        #: OrderedDict).
        self.repeated: tuple[bytes, bytes, bytes, bytes] | None = None
        self.class_refs: dict[torch.dtype, bytes] = {}  # per dtype, its class's reference

    def memoize(self, value: Any) -> bytes:
        """Memoize ``value`` (by identity): its ``BINPUT``."""
        index = self.count
        self.memo[id(value)] = index
        self.keep.append(value)
        self.count = index + 1
        return _put(index)

    def fresh(self) -> bytes:
        """Memoize a temporary nothing else can refer to: its ``BINPUT``."""
        index = self.count
        self.count = index + 1
        return _put(index)

    def global_record(self, value: Any, record: bytes) -> bytes:
        """A class or function: its ``GLOBAL`` the first time, then a ``BINGET``."""
        index = self.memo.get(id(value))
        if index is not None:
            return _get(index)
        return record + self.memoize(value)

    def str_record(self, value: str) -> bytes:
        """A ``str``: its ``BINUNICODE`` the first time (that object), then a ``BINGET``."""
        index = self.memo.get(id(value))
        if index is not None:
            return _get(index)
        encoded = value.encode("utf-8", "surrogatepass")
        return b"X" + _LONG.pack(len(encoded)) + encoded + self.memoize(value)

    def tuple_body(self, values: tuple[int, ...]) -> bytes:
        """A shape's or stride's records before its ``BINPUT`` (cached per value)."""
        body = self.shape_bodies.get(values)
        if body is None:
            body = self.shape_bodies[tuple(values)] = _tuple_body(values)
        return body

    def write_tensor(self, value: torch.Tensor) -> None:
        """A tensor's first reference, as ``flatten``'s pickler writes it."""
        i = self.next_tensor
        if i >= len(self.tensors) or self.tensors[i] is not value:
            raise _Unsupported  # the walk saw another order: let the pickler decide
        self.next_tensor = i + 1
        dtypes, shapes, strides, offsets, indices, requires_grad, _, sizes = self.columns
        storage, dtype, keys = indices[i], dtypes[i], self.keys
        if storage == len(keys):
            keys.append(str(storage))  # as ``flatten`` makes its keys: new objects
        elif storage > len(keys):
            raise _Unsupported
        kind = self.classes.get(dtype)
        if kind is None:
            raise _Unsupported
        # As the pickler writes ``(_rebuild_tensor_v2, (storage, offset, size, stride,
        # requires_grad, OrderedDict()))``: the storage as its persistent id (a fresh tuple
        # each time, memoized after its items), each tuple memoized after its items. The
        # records are made in the order written: each takes the next memo index.
        repeated = self.repeated
        key = keys[storage]
        memo = self.memo
        cls = self.class_refs.get(dtype)
        if repeated is not None and cls is not None and id(key) not in memo:
            self.write_repeated(i, value, repeated, cls, key, storage, dtype)
            return
        if repeated is None:
            rebuild = self.global_record(torch._utils._rebuild_tensor_v2, _REBUILD)
            tag = self.str_record(_STORAGE_TAG)
        else:
            rebuild, tag, loc, hooks = repeated
        cls = cls or self.global_record(kind, _global(kind))
        index = memo.get(id(key))
        key_record = b"X" + _key_body(key) + self.memoize(key) if index is None else _get(index)
        if repeated is None:
            loc = self.str_record(self.location)
        numel = _int(sizes[storage] // dtype.itemsize)
        pid = self.fresh()
        shape, stride = shapes[i], strides[i]
        shape_body = self.tuple_body(shape)
        shape_put = self.fresh() if shape else b""
        stride_body = self.tuple_body(stride)
        stride_put = self.fresh() if stride else b""
        if repeated is None:
            hooks = self.global_record(_OrderedDict, _ORDERED_DICT)
        hooks_put = self.fresh()
        arguments_put = self.fresh()
        self.write(
            b"".join((
                rebuild, b"((", tag, cls, key_record, loc, numel, b"t", pid, b"Q",
                _int(offsets[i]), shape_body, shape_put, stride_body, stride_put,
                b"\x88" if requires_grad[i] else b"\x89", hooks, b")R", hooks_put, b"t",
                arguments_put, b"R", self.memoize(value),
            ))
        )  # fmt: skip
        if repeated is None:
            self.repeated = (
                _get(memo[id(torch._utils._rebuild_tensor_v2)]),
                _get(memo[id(_STORAGE_TAG)]),
                _get(memo[id(self.location)]),
                _get(memo[id(_OrderedDict)]),
            )
        if dtype not in self.class_refs:
            self.class_refs[dtype] = _get(memo[id(kind)])

    def write_repeated(
        self,
        i: int,
        value: torch.Tensor,
        repeated: tuple[bytes, bytes, bytes, bytes],
        cls: bytes,
        key: str,
        storage: int,
        dtype: torch.dtype,
    ) -> None:
        """:meth:`write_tensor` for the usual tensor: every repeated record already memoized
        and its storage new (what thousands of tensors are), the memo indices counted here."""
        _, shapes, strides, offsets, _, requires_grad, _, sizes = self.columns
        rebuild, tag, loc, hooks = repeated
        c = self.count
        self.memo[id(key)] = c  # ``keys`` keeps it alive
        shape, stride = shapes[i], strides[i]
        parts = [
            rebuild, b"((", tag, cls, b"X", _key_body(key), _put(c), loc,
            _int(sizes[storage] // dtype.itemsize), b"t", _put(c + 1), b"Q", _int(offsets[i]),
            self.shape_bodies.get(shape) or self.tuple_body(shape),
        ]  # fmt: skip
        c += 2
        if shape:
            parts.append(_put(c))
            c += 1
        parts.append(self.shape_bodies.get(stride) or self.tuple_body(stride))
        if stride:
            parts.append(_put(c))
            c += 1
        parts += (
            b"\x88" if requires_grad[i] else b"\x89", hooks, b")R", _put(c), b"t", _put(c + 1),
            b"R", _put(c + 2),
        )  # fmt: skip
        self.memo[id(value)] = c + 2
        self.keep.append(value)
        self.count = c + 3
        self.write(b"".join(parts))

    def save(self, value: Any) -> None:
        """Write ``value`` as the C pickler's ``save`` does, or raise :class:`_Unsupported`."""
        kind = type(value)
        write = self.write
        if value is None:
            write(b"N")
        elif kind is bool:
            write(b"\x88" if value else b"\x89")
        elif kind is int:
            write(_int(value))
        elif kind is float:
            write(b"G" + _FLOAT.pack(value))
        elif kind is str:
            write(self.str_record(value))
        elif (index := self.memo.get(id(value))) is not None:
            write(_get(index))
        elif kind is _Tensor:
            self.write_tensor(value)
        elif kind is dict:
            write(b"}")
            write(self.memoize(value))
            self.exact_items(value)
        elif kind is list:
            write(b"]")
            write(self.memoize(value))
            self.list_items(value)
        elif kind is tuple:
            self.save_tuple(value)
        elif kind is _OrderedDict:
            write(self.global_record(_OrderedDict, _ORDERED_DICT))
            write(b")R")
            write(self.memoize(value))
            self.iterated_items(value)
            state = vars(value)
            if state:  # OrderedDict.__reduce__'s state: its __dict__ itself
                self.save(state)
                write(b"b")
        else:
            raise _Unsupported

    def save_tuple(self, value: tuple[Any, ...]) -> None:
        """A tuple: ``EMPTY_TUPLE``, ``TUPLE1``-``TUPLE3`` or ``MARK ... TUPLE``, memoized."""
        n = len(value)
        if n == 0:
            self.write(b")")
            return
        if n > 3:
            self.write(b"(")
        for item in value:
            self.save(item)
        if id(value) in self.memo:
            raise _Unsupported  # reached from its own items: the pickler's POP case
        self.write(b"t" if n > 3 else b"\x85\x86\x87"[n - 1 : n])
        self.write(self.memoize(value))

    def list_items(self, value: list[Any]) -> None:
        """``batch_list_exact``: one item is an ``APPEND``; else batches of 1000."""
        n = len(value)
        if n == 1:
            self.save(value[0])
            self.write(b"a")
            return
        for start in range(0, n, _BATCH):
            self.write(b"(")
            for item in value[start : start + _BATCH]:
                self.save(item)
            self.write(b"e")

    def exact_items(self, value: dict[Any, Any]) -> None:
        """``batch_dict_exact``: one item is a ``SETITEM``; otherwise batches of 1000, and a
        full last batch is followed by an empty one."""
        n = len(value)
        if n == 0:
            return
        if n == 1:
            for k, v in value.items():
                self.save(k)
                self.save(v)
            self.write(b"s")
            return
        items = list(value.items())
        start = 0
        while True:
            batch = items[start : start + _BATCH]
            self.write(b"(")
            for k, v in batch:
                self.save(k)
                self.save(v)
            self.write(b"u")
            start += _BATCH
            if len(batch) < _BATCH:
                break

    def iterated_items(self, value: dict[Any, Any]) -> None:
        """``batch_dict`` over an iterator (an ``OrderedDict``'s): a batch of one item is a
        ``SETITEM``, and no empty batch is written."""
        items = list(value.items())
        for start in range(0, len(items), _BATCH):
            batch = items[start : start + _BATCH]
            if len(batch) == 1:
                self.save(batch[0][0])
                self.save(batch[0][1])
                self.write(b"s")
                continue
            self.write(b"(")
            for k, v in batch:
                self.save(k)
                self.save(v)
            self.write(b"u")


_REBUILD = _global(torch._utils._rebuild_tensor_v2)
_ORDERED_DICT = _global(_OrderedDict)


def encode_flattened(
    obj: Any,
    tensors: Sequence[torch.Tensor],
    storages: Sequence[torch.UntypedStorage],
    columns: Sequence[Any],
    storage_ids: Sequence[int],
) -> Flattened | None:
    """``flatten(obj)`` for a plain object on the CPU, its skeleton written by
    :func:`encode_skeleton` from the plan cache's walk (``tensors``, ``storages``,
    ``columns``, and per tensor its storage's ``_cdata``: ``storage_ids``); ``None`` where
    that does not apply (the caller flattens)."""
    if not storages:
        return None
    location = torch.serialization.location_tag(storages[0])
    skeleton = encode_skeleton(obj, tensors, columns, location)
    if skeleton is None:
        return None
    dtypes, indices, sizes = columns[0], columns[4], columns[7]
    first_dtype: dict[int, torch.dtype] = {}
    cdata: dict[int, int] = {}  # storage index -> its ``_cdata``, which names are keyed by
    for index, dtype, storage_id in zip(indices, dtypes, storage_ids, strict=True):
        if index not in first_dtype:
            first_dtype[index] = dtype
            cdata[index] = storage_id
    names = tensor_names(obj)
    infos = tuple(
        StorageInfo(
            key=str(s),
            nbytes=sizes[s],
            dtype=str(first_dtype[s]).removeprefix("torch."),
            location=location,
            name=names.get(cdata[s], f"<storage {s}>"),
        )
        for s in range(len(storages))
    )
    # encode_skeleton writes none but CPU tensors (it returned None above otherwise).
    return Flattened(skeleton, infos, tuple(storages), tuple(tensors), on_cpu=True)
