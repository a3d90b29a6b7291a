"""The records of a stored (uncompressed) zip archive, read straight from its central directory.

A persist lists every record of the archive before its first byte is written, so the disk
waits for the listing: :mod:`zipfile` makes a ``ZipInfo`` per record and copies the central
directory through a file object, slow for thousands of records. This reads the same fields
with one ``struct`` call per entry and per local header, in place.

It accepts what ``zipfile`` accepts for such an archive and checks more: the end records must
sit at the very end (no archive comment: ``torch.save`` and this project write none), the
central directory must end where they begin (no data prepended to the archive, which
``zipfile`` would shift every offset for), every entry must lie inside it, and each local
header must agree with its entry (name) and leave room for its data before the next record.
Anything else raises :class:`~ckptcache.errors.CorruptCheckpoint`.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.gcpause import gc_paused

__all__ = ["ArchiveRecord", "central_directory", "central_offset", "list_records",
           "storage_corrupt"]  # fmt: skip

_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_CENTRAL = struct.Struct("<IBBBBHHHHIIIHHHHHII")  # 46 bytes
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_U32 = 0xFFFFFFFF
_UTF8_NAME = 0x800
#: The newest "version needed to extract" ``zipfile`` reads (6.3).
_MAX_EXTRACT_VERSION = 63


class ArchiveRecord(NamedTuple):
    """One record of an archive: where its header, data and descriptor lie."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int
    #: Offset of the next record's header (or of the central directory) after this one.
    end: int


def storage_corrupt(path: str, what: str, *, tensor: str | None = None) -> CorruptCheckpoint:
    """The error for damage found in the stored object at ``path``."""
    return CorruptCheckpoint(
        f"checkpoint file {path!r} is corrupt in the storage tier: {what}",
        tensor=tensor, tier="storage",
    )  # fmt: skip


def central_directory(view: memoryview, path: str = "<archive>") -> tuple[int, int, int]:
    """``(offset, size, entries)`` of the central directory, from the end records at the very
    end of ``view`` (the zip64 ones where present, as ``zipfile`` reads them)."""
    total = len(view)
    if total < _EOCD.size:
        raise storage_corrupt(path, "too short to be a zip archive (truncated)")
    sig, disk, _, _, entries, size, offset, comment = _EOCD.unpack_from(view, total - _EOCD.size)
    if sig != 0x06054B50 or comment:
        raise storage_corrupt(path, "no end-of-central-directory record (truncated)")
    if disk:
        raise storage_corrupt(path, "an archive that spans several disks")
    ends_at = total - _EOCD.size
    locator_at = ends_at - _LOCATOR.size
    if locator_at >= _EOCD64.size and view[locator_at : locator_at + 4] == b"PK\x06\x07":
        _, disk, eocd64_at, disks = _LOCATOR.unpack_from(view, locator_at)
        if disk or disks > 1:
            raise storage_corrupt(path, "an archive that spans several disks")
        if eocd64_at != locator_at - _EOCD64.size:
            raise storage_corrupt(path, "the zip64 end record is not before its locator")
        sig, _, _, _, disk, _, _, entries64, size64, offset64 = _EOCD64.unpack_from(view, eocd64_at)
        if sig != 0x06064B50 or disk:
            raise storage_corrupt(path, "bad zip64 end record")
        if offset not in (offset64, _U32) or entries not in (entries64 & 0xFFFF, 0xFFFF):
            raise storage_corrupt(path, "the end records disagree")
        entries, size, offset, ends_at = entries64, size64, offset64, eocd64_at
    if offset + size != ends_at:
        raise storage_corrupt(
            path, f"the central directory ({size} bytes at {offset}) does not end where the "
            f"end records begin ({ends_at}): truncated, or bytes added")  # fmt: skip
    if entries > size // _CENTRAL.size:
        raise storage_corrupt(path, f"the end records claim {entries} records in {size} bytes")
    return offset, size, entries


def central_offset(view: memoryview, path: str = "<archive>") -> int:
    """Offset of the central directory, from the (zip64) end records at the end of ``view``."""
    return central_directory(view, path)[0]


def list_records(view: memoryview, path: str = "<archive>") -> tuple[list[ArchiveRecord], int]:
    """The records of the stored zip archive in ``view`` in file order, and the central
    directory's offset; raises :class:`CorruptCheckpoint` for a truncated or malformed archive
    (see the module docstring), a compressed record, or a central directory that disagrees
    with its end record (count) or local headers (names, room for the data)."""
    try:
        with gc_paused():  # thousands of tuples, none in a cycle
            return _list_records(view, path)
    except struct.error as e:  # a field past the end of the view
        raise storage_corrupt(path, f"truncated record: {e}") from e
    except UnicodeDecodeError as e:
        raise storage_corrupt(path, f"a record's name is not UTF-8: {e}") from e


def _list_records(view: memoryview, path: str) -> tuple[list[ArchiveRecord], int]:
    cd_offset, cd_size, entries = central_directory(view, path)
    central = bytes(view[cd_offset : cd_offset + cd_size])  # bytes slice faster than views
    cd_end = cd_size
    unpack_central = _CENTRAL.unpack_from
    listed = []  # (header offset, name, raw name, size, crc)
    pos = 0
    while pos < cd_end:
        if pos + _CENTRAL.size > cd_end:
            raise storage_corrupt(path, "truncated central directory")
        (sig, _, _, extract_version, _, flags, method, _, _, crc, csize, size, name_len, extra_len,
         comment_len, _, _, _, offset) = unpack_central(central, pos)  # fmt: skip
        if sig != 0x02014B50:
            raise storage_corrupt(path, "bad magic number for central directory")
        name_at = pos + _CENTRAL.size
        pos = name_at + name_len + extra_len + comment_len
        if pos > cd_end:
            raise storage_corrupt(path, "a central directory entry runs past its end")
        raw = central[name_at : name_at + name_len]
        name = raw.decode("utf-8" if flags & _UTF8_NAME else "cp437").split("\0", 1)[0]
        if extract_version > _MAX_EXTRACT_VERSION:
            raise storage_corrupt(path, f"record {name!r} needs zip version "
                                  f"{extract_version / 10:.1f}")  # fmt: skip
        if method != 0:
            raise storage_corrupt(path, f"compressed record {name!r}")
        if extra_len:
            extra = central[name_at + name_len : name_at + name_len + extra_len]
            size, offset = _zip64(extra, size, csize, offset, name, path)
        listed.append((offset, name, raw, size, crc))
    if len(listed) != entries:  # an entry's lengths changed: it swallowed or split others
        raise storage_corrupt(
            path, f"the end record counts {entries} records, the central directory {len(listed)}"
        )
    listed.sort(key=lambda entry: entry[0])
    unpack_local = _LOCAL.unpack_from
    records = []
    for n, (start, name, raw, size, crc) in enumerate(listed):
        end = listed[n + 1][0] if n + 1 < len(listed) else cd_offset
        if start + _LOCAL.size > end:
            raise storage_corrupt(path, f"bad local header of record {name!r}")
        fields = unpack_local(view, start)
        if fields[0] != 0x04034B50:
            raise storage_corrupt(path, f"bad local header of record {name!r}")
        name_at = start + _LOCAL.size
        if view[name_at : name_at + fields[9]] != raw:
            local_name = bytes(view[name_at : name_at + fields[9]])
            raise storage_corrupt(path, f"the local header of record {name!r} names "
                                  f"{local_name!r}")  # fmt: skip
        data = name_at + fields[9] + fields[10]
        if data + size > end:
            raise storage_corrupt(path, f"record {name!r} runs past its end (truncated)")
        records.append(ArchiveRecord(name, start, data, size, crc, end))
    return records, cd_offset


def _zip64(
    extra: bytes, size: int, csize: int, offset: int, name: str, path: str
) -> tuple[int, int]:
    """The size and header offset of a record after its extra fields (each checked to lie
    inside them): a zip64 field holds, in this order, the size, the compressed size and the
    offset, each only where its 32-bit field is saturated (as ``zipfile`` reads them)."""
    at = 0
    while len(extra) - at >= 4:
        kind, length = struct.unpack_from("<HH", extra, at)
        if at + 4 + length > len(extra):
            raise storage_corrupt(path, f"corrupt extra field of record {name!r}")
        if kind == 0x0001:
            fields = (("size", size), ("csize", csize), ("offset", offset))
            saturated = [field for field, value in fields if value == _U32]
            if length < 8 * len(saturated):
                raise storage_corrupt(path, f"corrupt zip64 field of record {name!r}")
            for i, field in enumerate(saturated):
                (value,) = struct.unpack_from("<Q", extra, at + 4 + 8 * i)
                if field == "size":
                    size = value
                elif field == "csize":
                    csize = value
                else:
                    offset = value
        at += 4 + length
    return size, offset
