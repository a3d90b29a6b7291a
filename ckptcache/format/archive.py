"""Plan the byte layout of a ``torch.save``-compatible zip archive before any tensor is copied.

A segment's payload *is* the archive ``torch.save`` would have written (stored entries, storages
64-byte aligned, data descriptors and zip64 records placed the way PyTorch's miniz writer places
them), so persisting a checkpoint is a plain byte copy of the payload and ``torch.load`` reads
the persisted file with no ckptcache installed.

Because every size is known up front, the layout is computed once as a list of metadata pieces
``(offset, bytes)``; the storage bytes are then copied by the caller straight to their offsets.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptcache.errors import CorruptCheckpoint

__all__ = [
    "ARCHIVE_ALIGNMENT",
    "PARSE_ERRORS",
    "ArchivePlan",
    "ParsedArchive",
    "ViewReader",
    "central_record",
    "count_records",
    "end_records",
    "parse_archive",
    "plan_archive",
]

#: Alignment of every record's data, as ``torch.utils.serialization.config.save.storage_alignment``.
ARCHIVE_ALIGNMENT = 64

_U32_MAX = 0xFFFFFFFF
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_FLAGS = 0x0808  # bit 3: sizes in a data descriptor; bit 11: UTF-8 names (as miniz writes them)


@dataclass(frozen=True)
class ArchivePlan:
    """Where everything of one archive goes.

    ``pieces`` are the metadata bytes (headers, small records, descriptors, central directory)
    with their offsets from the start of the archive; ``storage_offsets[i]`` is where the bytes
    of storage ``i`` (record ``data/i``) start. ``size`` is the archive's total length.
    """

    size: int
    pieces: tuple[tuple[int, bytes], ...]
    storage_offsets: tuple[int, ...]
    pickle_offset: int
    pickle_size: int
    #: Index in ``pieces`` of the ``.data/serialization_id`` record's bytes (-1: none).
    id_piece: int = -1
    #: The small pieces as one scatter (positions, bytes), with the indices of the pieces
    #: written by slice (the large ones: the pickle, the central directory; and the two a
    #: replan changes: the pickle and the serialization id), made at the first write of a
    #: plan of many pieces and shared by its replans: a state of thousands of tensors has
    #: three pieces per tensor, and one slice assignment each cost more than the rest of a
    #: save.
    _scatter: list[tuple[Any, Any, tuple[int, ...]]] = dataclasses.field(
        default_factory=list, init=False, compare=False, repr=False
    )

    def with_serialization_id(self, serialization_id: str) -> ArchivePlan:
        """This plan for an archive that differs only by its serialization id (as long)."""
        old = self.pieces[self.id_piece][1]
        new = serialization_id.encode()
        if self.id_piece < 0 or len(new) != len(old):
            raise ValueError("the serialization id must keep its length")
        return self._with_piece(self.id_piece, new)

    def with_pickle(self, pickle_bytes: bytes) -> ArchivePlan:
        """This plan for an archive whose ``data.pkl`` is ``pickle_bytes`` (as long)."""
        offset, old = self.pieces[_PICKLE_PIECE]
        if len(pickle_bytes) != len(old) or offset != self.pickle_offset:
            raise ValueError("the pickle must keep its length")
        return self._with_piece(_PICKLE_PIECE, pickle_bytes)

    def _with_piece(self, index: int, data: bytes) -> ArchivePlan:
        """This plan with piece ``index`` (one the scatter leaves out) holding ``data``."""
        pieces = list(self.pieces)
        pieces[index] = (pieces[index][0], data)
        plan = dataclasses.replace(self, pieces=tuple(pieces))
        plan._scatter.extend(self._scatter)  # the scatter holds neither piece: shared as it is
        return plan

    def write_metadata(self, buf: memoryview) -> None:
        """Write every metadata piece into ``buf`` (a writable view of the archive's bytes)."""
        if len(self.pieces) < _SCATTER_FROM:
            for offset, data in self.pieces:
                buf[offset : offset + len(data)] = data
            return
        import numpy as np

        if not self._scatter:
            self._scatter.append(self._make_scatter())
        positions, values, direct = self._scatter[0]
        np.frombuffer(buf, dtype=np.uint8)[positions] = values
        for index in direct:
            offset, data = self.pieces[index]
            buf[offset : offset + len(data)] = data

    def _make_scatter(self) -> tuple[Any, Any, tuple[int, ...]]:
        import numpy as np

        direct = {_PICKLE_PIECE, self.id_piece} - {-1}
        direct.update(i for i, (_, data) in enumerate(self.pieces) if len(data) >= _DIRECT_FROM)
        small = [piece for i, piece in enumerate(self.pieces) if i not in direct]
        lengths = np.fromiter((len(d) for _, d in small), np.int64, len(small))
        starts = np.fromiter((o for o, _ in small), np.int64, len(small))
        before = np.cumsum(lengths) - lengths  # where each piece starts in ``values``
        positions = np.arange(int(lengths.sum())) + np.repeat(starts - before, lengths)
        values = np.frombuffer(b"".join(d for _, d in small), dtype=np.uint8).copy()
        return positions, values, tuple(sorted(direct))


#: Plans of this many pieces or more write them as one scatter.
_SCATTER_FROM = 64
#: Pieces of this many bytes or more are written by slice, even in a scatter's plan.
_DIRECT_FROM = 4096
#: Index in ``pieces`` of ``data.pkl``'s bytes (its local header is piece 0).
_PICKLE_PIECE = 1


@dataclass(frozen=True)
class _Entry:
    name: bytes
    header_offset: int
    data_offset: int
    size: int


def _padding_extra(header_offset: int, name_len: int, alignment: int) -> bytes:
    """The ``FB`` extra field miniz adds so that the record's data starts aligned."""
    start = header_offset + _LOCAL_HEADER.size + name_len
    pad = (-start) % alignment
    if pad == 0:
        return b""
    # The extra field needs 4 bytes of its own header; if they do not fit, pad one more block.
    if pad < 4:
        pad += alignment
    return b"FB" + struct.pack("<H", pad - 4) + b"Z" * (pad - 4)


def _descriptor(entry: _Entry) -> bytes:
    if entry.header_offset >= _U32_MAX or entry.size >= _U32_MAX:
        return struct.pack("<IIQQ", 0x08074B50, 0, entry.size, entry.size)
    return struct.pack("<IIII", 0x08074B50, 0, entry.size, entry.size)


def _central_record(entry: _Entry) -> bytes:
    return central_record(entry.name, entry.header_offset, entry.size)


def central_record(name: bytes, header_offset: int, size: int, *, crc: int = 0,
                   flags: int = _FLAGS) -> bytes:  # fmt: skip
    """A central directory entry of a stored record (zip64 fields where needed)."""
    zip64: list[int] = []
    size32 = size
    offset32 = header_offset
    if size >= _U32_MAX:
        size32 = _U32_MAX
        zip64 += [size, size]
    if header_offset >= _U32_MAX:
        offset32 = _U32_MAX
        zip64.append(header_offset)
    extra = b""
    if zip64:
        extra = struct.pack(f"<HH{len(zip64)}Q", 0x0001, 8 * len(zip64), *zip64)
    header = _CENTRAL_HEADER.pack(
        0x02014B50, 0, 0, flags, 0, 0, 0, crc, size32, size32, len(name), len(extra),
        0, 0, 0, 0, offset32,
    )  # fmt: skip
    return header + name + extra


def end_records(n_entries: int, cd_offset: int, cd_size: int) -> bytes:
    """The zip64 end record, its locator and the end-of-central-directory record."""
    eocd64_offset = cd_offset + cd_size
    eocd64 = struct.pack(
        "<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n_entries, n_entries, cd_size, cd_offset
    )
    locator = struct.pack("<IIQI", 0x07064B50, 0, eocd64_offset, 1)
    n16 = min(n_entries, 0xFFFF)
    eocd = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, n16, n16, min(cd_size, _U32_MAX),
        min(cd_offset, _U32_MAX), 0,
    )  # fmt: skip
    return eocd64 + locator + eocd


def plan_archive(
    pickle_bytes: bytes,
    storage_sizes: Sequence[int],
    *,
    archive_name: str = "archive",
    serialization_id: str = "0" * 40,
    alignment: int = ARCHIVE_ALIGNMENT,
) -> ArchivePlan:
    """Lay out an archive holding ``pickle_bytes`` as ``data.pkl`` and storages ``data/0..n-1``.

    The record order is ``torch.save``'s: ``data.pkl``, ``.format_version``,
    ``.storage_alignment``, ``byteorder``, the storages in key order, ``version``, and
    ``.data/serialization_id``.
    """
    small_before = [
        ("data.pkl", pickle_bytes),
        (".format_version", b"1"),
        (".storage_alignment", str(alignment).encode()),
        ("byteorder", sys.byteorder.encode()),
    ]
    small_after = [("version", b"3\n"), (".data/serialization_id", serialization_id.encode())]
    records: list[tuple[str, bytes | int]] = [*small_before]
    records += [(f"data/{i}", size) for i, size in enumerate(storage_sizes)]
    records += small_after
    prefix = f"{archive_name}/"
    names = [(prefix + name).encode() for name, _ in records]
    sizes = [content if isinstance(content, int) else len(content) for _, content in records]
    laid = layout_records(names, sizes, alignment)
    if laid is None:  # an archive past 4 GiB: zip64 records, laid out one at a time
        return _plan_one_by_one(
            records, names, sizes, len(small_before), len(storage_sizes), alignment,
            len(pickle_bytes),
        )  # fmt: skip
    header_offsets, data_offsets = laid
    contents = [content if isinstance(content, bytes) else None for _, content in records]
    return _bulk_plan(names, sizes, contents, header_offsets, data_offsets, alignment,
                      len(small_before), len(storage_sizes), len(pickle_bytes))  # fmt: skip


def _plan_one_by_one(
    records: list[tuple[str, bytes | int]],
    names: list[bytes],
    sizes: list[int],
    n_small: int,
    n_storages: int,
    alignment: int,
    pickle_size: int,
) -> ArchivePlan:
    """:func:`plan_archive` one record at a time (any size or offset: zip64 where needed)."""
    pieces: list[tuple[int, bytes]] = []
    entries: list[_Entry] = []
    offset = 0
    id_piece = -1
    for (name, content), full_name, size in zip(records, names, sizes, strict=True):
        extra = _padding_extra(offset, len(full_name), alignment)
        local = _LOCAL_HEADER.pack(
            0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(full_name), len(extra)
        )
        data_offset = offset + len(local) + len(full_name) + len(extra)
        pieces.append((offset, local + full_name + extra))
        entry = _Entry(full_name, offset, data_offset, size)
        entries.append(entry)
        if not isinstance(content, int):
            if name == ".data/serialization_id":
                id_piece = len(pieces)
            pieces.append((data_offset, content))
        # miniz writes a data descriptor only after non-empty records.
        descriptor = _descriptor(entry) if size > 0 else b""
        if descriptor:
            pieces.append((data_offset + size, descriptor))
        offset = data_offset + size + len(descriptor)

    cd_offset = offset
    central = b"".join(_central_record(e) for e in entries)
    pieces.append((cd_offset, central + end_records(len(entries), cd_offset, len(central))))
    return ArchivePlan(
        size=cd_offset + len(central) + 56 + 20 + 22,
        pieces=tuple(pieces),
        storage_offsets=tuple(e.data_offset for e in entries[n_small : n_small + n_storages]),
        pickle_offset=entries[0].data_offset,
        pickle_size=pickle_size,
        id_piece=id_piece,
    )


#: A data descriptor without zip64 fields (what every record of an archive under 4 GiB has).
_DESCRIPTOR_SIZE = 16


def layout_records(
    names: Sequence[bytes], sizes: Sequence[int], alignment: int = ARCHIVE_ALIGNMENT
) -> tuple[list[int], list[int]] | None:
    """Every record's local header offset and data offset: ``(header_offsets,
    data_offsets)`` for records ``names`` of ``sizes`` bytes laid out from offset 0 as
    :func:`plan_archive` lays them out; None when a record needs zip64 fields (a size or a
    header offset of 4 GiB or more), whose layout is left to the one-record-at-a-time path.

    Integer arithmetic only, in one pass: no bytes are made here. Not numpy: its loops release
    the GIL, and a save planned beside a busy thread (the client's own) then waits a switch
    interval at each of them (many times the whole layout's cost).
    """
    if not names or max(sizes) >= _U32_MAX:
        return None
    headers: list[int] = []
    datas: list[int] = []
    offset = 0
    fixed = _LOCAL_HEADER.size
    for name, size in zip(names, sizes, strict=True):
        start = offset + fixed + len(name)
        pad = -start % alignment
        if 0 < pad < 4:  # the extra field's own 4 bytes must fit
            pad += alignment
        headers.append(offset)
        data = start + pad
        datas.append(data)
        # miniz writes a data descriptor only after non-empty records.
        offset = data + size + (_DESCRIPTOR_SIZE if size > 0 else 0)
    if headers[-1] >= _U32_MAX:
        return None
    return headers, datas


#: The ``FB`` padding extra field for each padding length.
_EXTRA_BY_PAD: dict[int, bytes] = {}


def _extra_of(pad: int) -> bytes:
    extra = _EXTRA_BY_PAD.get(pad)
    if extra is None:
        extra = b"FB" + struct.pack("<H", pad - 4) + b"Z" * (pad - 4) if pad else b""
        _EXTRA_BY_PAD[pad] = extra
    return extra


def _bulk_plan(
    names: list[bytes],
    sizes: list[int],
    contents: list[bytes | None],
    header_offsets: list[int],
    data_offsets: list[int],
    alignment: int,
    n_small: int,
    n_storages: int,
    pickle_size: int,
) -> ArchivePlan:
    """The plan of records laid out by :func:`layout_records` (no zip64 fields): the same
    pieces, in the same order, as :func:`_plan_one_by_one` gives."""
    local_pack = _LOCAL_HEADER.pack
    pieces: list[tuple[int, bytes]] = []
    append = pieces.append
    id_piece = -1
    last = len(names) - 1
    descriptors = iter(_descriptors(sizes))
    # A local header depends only on its name's length and its padding: one pack per pair.
    heads: dict[tuple[int, int], tuple[bytes, bytes]] = {}
    for i, (name, size, content, header, data) in enumerate(
        zip(names, sizes, contents, header_offsets, data_offsets, strict=True)
    ):
        n_name = len(name)
        key = (n_name, data - header)
        head = heads.get(key)
        if head is None:
            extra = _extra_of(data - header - _LOCAL_HEADER.size - n_name)
            head = (local_pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, n_name, len(extra)),
                    extra)  # fmt: skip
            heads[key] = head
        append((header, head[0] + name + head[1]))
        if content is not None:
            if i == last:  # the serialization id
                id_piece = len(pieces)
            append((data, content))
        if size > 0:
            append((data + size, next(descriptors)))
    cd_offset = data_offsets[-1] + sizes[-1] + (_DESCRIPTOR_SIZE if sizes[-1] > 0 else 0)
    directory = _central_directory(names, sizes, header_offsets)
    append((cd_offset, directory + end_records(len(names), cd_offset, len(directory))))
    return ArchivePlan(
        size=cd_offset + len(directory) + 56 + 20 + 22,
        pieces=tuple(pieces),
        storage_offsets=tuple(data_offsets[n_small : n_small + n_storages]),
        pickle_offset=data_offsets[0],
        pickle_size=pickle_size,
        id_piece=id_piece,
    )


def _descriptors(sizes: list[int]) -> list[bytes]:
    """The data descriptor (no zip64 fields) of each non-empty record."""
    pack = _DESCRIPTOR.pack
    return [pack(0x08074B50, 0, size, size) for size in sizes if size > 0]


_DESCRIPTOR = struct.Struct("<IIII")


def _central_directory(names: list[bytes], sizes: list[int], header_offsets: list[int]) -> bytes:
    """The central directory (no zip64 fields) of every record."""
    pack = _CENTRAL_HEADER.pack
    return b"".join([
        pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, 0, size, size, len(name), 0, 0, 0, 0, 0, header)
        + name
        for name, size, header in zip(names, sizes, header_offsets, strict=True)
    ])  # fmt: skip


@dataclass(frozen=True)
class ParsedArchive:
    """Where the pickle and each storage record lie inside an existing archive."""

    pickle_offset: int
    pickle_size: int
    #: storage key -> (data offset, size), in key order
    storages: dict[str, tuple[int, int]]


class ViewReader(io.RawIOBase):
    """A seekable file over a memoryview, so zipfile can parse without copying the archive.

    The view holds the file's bytes ``[base, base + len(view))``: a read before ``base``
    raises ``OSError`` (a reader of part of a file, such as the DCP adapter's cached items)."""

    def __init__(self, view: memoryview, base: int = 0):
        super().__init__()
        self._view = view
        self._base = base
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        end = self._base + len(self._view)
        self._pos = max(0, {0: 0, 1: self._pos, 2: end}[whence] + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        start = self._pos - self._base
        if start < 0:
            raise OSError(f"offset {self._pos} lies before the bytes held (at {self._base})")
        out = memoryview(buf).cast("B")
        chunk = self._view[start : start + len(out)]
        out[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


#: What zipfile and struct raise on malformed input (zipfile trusts the sizes it reads).
PARSE_ERRORS = (
    zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, NotImplementedError,
    OverflowError, KeyError, IndexError,
)  # fmt: skip


def parse_archive(view: memoryview) -> ParsedArchive:
    """Locate ``data.pkl`` and every ``data/<key>`` record of a ``torch.save`` archive (ours or
    PyTorch's own writer's); raises :class:`CorruptCheckpoint` (a ``ValueError``) for anything
    that is not one."""
    try:
        return _parse_archive(view)
    except CorruptCheckpoint:
        raise
    except PARSE_ERRORS as e:
        raise CorruptCheckpoint(f"not a torch.save archive: {e}") from e


def _parse_archive(view: memoryview) -> ParsedArchive:
    infos = zipfile.ZipFile(io.BufferedReader(ViewReader(view))).infolist()
    pickle: tuple[int, int] | None = None
    storages: dict[str, tuple[int, int]] = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpoint(
                f"compressed record {info.filename!r}: not a torch.save archive"
            )
        local = bytes(view[info.header_offset : info.header_offset + _LOCAL_HEADER.size])
        fields = _LOCAL_HEADER.unpack(local)
        if fields[0] != 0x04034B50:
            raise CorruptCheckpoint(f"bad local header for {info.filename!r}")
        data = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if data + info.file_size > len(view):
            raise CorruptCheckpoint(f"record {info.filename!r} runs past the end (truncated file)")
        name = info.filename.split("/", 1)[-1]
        if name == "data.pkl":
            pickle = (data, info.file_size)
        elif name.startswith("data/"):
            storages[name[5:]] = (data, info.file_size)
    if pickle is None:
        raise CorruptCheckpoint("no data.pkl record: not a torch.save archive")
    ordered = dict(sorted(storages.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))
    return ParsedArchive(pickle[0], pickle[1], ordered)


def count_records(size: int, read: Any) -> int:
    """Records in an archive of ``size`` bytes, from its end records alone.

    ``read(offset, n) -> bytes`` reads a range; only the last few dozen bytes are needed.
    Raises :class:`CorruptCheckpoint` (a ``ValueError``) when the end records are malformed
    or claim more records than ``size`` bytes can hold.
    """
    if size < 22:
        raise CorruptCheckpoint("too short to be a zip archive")
    try:
        entries = _count_records(size, read)
    except struct.error as e:
        raise CorruptCheckpoint(f"truncated zip end records: {e}") from e
    if entries > size // 46:  # every record has a central directory entry of 46+ bytes
        raise CorruptCheckpoint(f"zip end records claim {entries} records in {size} bytes")
    return entries


def _count_records(size: int, read: Any) -> int:
    eocd = read(size - 22, 22)
    if eocd[:4] != b"PK\x05\x06":
        raise CorruptCheckpoint(
            "no end-of-central-directory record (truncated or commented archive)"
        )
    entries = struct.unpack_from("<H", eocd, 10)[0]
    if entries != 0xFFFF or size < 22 + 20:
        return int(entries)
    locator = read(size - 42, 20)
    if locator[:4] != b"PK\x06\x07":
        return int(entries)
    (eocd64_offset,) = struct.unpack_from("<Q", locator, 8)
    if eocd64_offset + 56 > size:
        raise CorruptCheckpoint("zip64 end record outside the archive")
    eocd64 = read(eocd64_offset, 56)
    return int(struct.unpack_from("<Q", eocd64, 32)[0])
