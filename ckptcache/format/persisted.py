"""The persisted form of a checkpoint: the segment's archive, checked while it is copied.

A segment's payload is a ``torch.save``-compatible zip archive written with CRC-32 = 0 (the
trainer's stall is one memory copy; it computes no checksum). On its way to storage the
daemon streams the archive record by record and, in the same pass over each chunk:

* computes the record's zip CRC-32 and writes it into the record's data descriptor and its
  central directory entry, so ``zipfile``'s ``testzip()`` and any zip tool can check the file;
* computes the record's xxh3 digest and, for a tensor storage, compares it with the digest the
  daemon recorded at commit: a mismatch raises :class:`CorruptCheckpoint` before the object
  becomes visible (the caller's temp file or multipart upload is discarded);
* appends one extra record, ``<archive>/.ckptcache/digests.json`` (see :data:`DIGESTS_MEMBER`),
  holding the xxh3 of every other record (skeleton, storages, small records). ``torch.load``
  ignores records it does not look up, so the file stays an ordinary checkpoint.

:func:`check_archive` is the reader's side: a cheap structural check (end records, central
directory, every record inside the file: catches truncation) and, with ``deep=True``, every
record's digest (or its CRC-32 for archives without the digest record, e.g. ``torch.save``'s).
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap as mmap_module
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive import ViewReader, central_record, count_records, end_records
from ckptcache.format.digest import DIGEST_ALGORITHM, digest_hex
from ckptcache.storage import StorageBackend, backend_for

__all__ = [
    "DIGESTS_FORMAT",
    "DIGESTS_MEMBER",
    "ArchiveRecord",
    "central_offset",
    "check_archive",
    "list_records",
    "load_from_storage",
    "stored_archive_complete",
    "stream_archive",
    "verify_stored",
]

#: Name of the digest record, relative to the archive's top folder.
DIGESTS_MEMBER = ".ckptcache/digests.json"
#: Version of the digest record's JSON; a reader refuses versions it does not know.
DIGESTS_FORMAT = 1

_CHUNK = 8 << 20  # hash-then-write granule: stays in cache between the hash and the write
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_FIXED = 46
_DESCRIPTOR_SIG = b"PK\x07\x08"

Sink = Callable[[memoryview | bytes], None]


@dataclass(frozen=True)
class ArchiveRecord:
    """One record of an archive: where its header, data and descriptor lie."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int
    #: Offset of the next record's header (or of the central directory) after this one.
    end: int


def _corrupt(path: str, what: str, *, tensor: str | None = None) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"checkpoint file {path!r} is corrupt: {what}", tensor=tensor, tier="storage"
    )


def list_records(view: memoryview, path: str = "<archive>") -> tuple[list[ArchiveRecord], int]:
    """The records of the zip archive in ``view`` in file order, and the central directory's
    offset; raises :class:`CorruptCheckpoint` for a truncated or malformed archive."""
    try:
        infos = zipfile.ZipFile(io.BufferedReader(ViewReader(view))).infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise _corrupt(path, f"{e} (truncated, or not a checkpoint archive)") from e
    infos.sort(key=lambda i: i.header_offset)
    cd_offset = central_offset(view, path)
    records = []
    for n, info in enumerate(infos):
        if info.compress_type != zipfile.ZIP_STORED:
            raise _corrupt(path, f"compressed record {info.filename!r}")
        start = info.header_offset
        local = bytes(view[start : start + _LOCAL.size])
        if len(local) < _LOCAL.size or local[:4] != b"PK\x03\x04":
            raise _corrupt(path, f"bad local header of record {info.filename!r}")
        fields = _LOCAL.unpack(local)
        data = start + _LOCAL.size + fields[9] + fields[10]
        end = infos[n + 1].header_offset if n + 1 < len(infos) else cd_offset
        if data + info.file_size > end:
            raise _corrupt(path, f"record {info.filename!r} runs past its end (truncated)")
        records.append(ArchiveRecord(info.filename, start, data, info.file_size, info.CRC, end))
    return records, cd_offset


def central_offset(view: memoryview, path: str = "<archive>") -> int:
    """Offset of the central directory, from the (zip64) end records at the end of ``view``
    (only the last few dozen bytes need to be in place)."""
    size = len(view)
    eocd = bytes(view[size - 22 : size])
    if size < 22 or eocd[:4] != b"PK\x05\x06":
        raise _corrupt(path, "no end-of-central-directory record (truncated)")
    (offset,) = struct.unpack_from("<I", eocd, 16)
    if offset != 0xFFFFFFFF:
        return int(offset)
    locator = bytes(view[size - 42 : size - 22])
    (eocd64,) = struct.unpack_from("<Q", locator, 8)
    return int(struct.unpack_from("<Q", bytes(view[eocd64 : eocd64 + 56]), 48)[0])


def _top_folder(records: list[ArchiveRecord]) -> str:
    return records[0].name.split("/", 1)[0] if records else "archive"


def _stream_record(view: memoryview, record: ArchiveRecord, sink: Sink) -> tuple[int, int]:
    """Write one record's header and data; return its (CRC-32, xxh3) from the same pass."""
    sink(view[record.header_offset : record.data_offset])
    crc = 0
    hasher = xxhash.xxh3_64()
    for start in range(record.data_offset, record.data_offset + record.size, _CHUNK):
        chunk = view[start : min(start + _CHUNK, record.data_offset + record.size)]
        crc = zlib.crc32(chunk, crc)
        hasher.update(chunk)
        sink(chunk)
    return crc, hasher.intdigest()


def _descriptor(view: memoryview, record: ArchiveRecord, crc: int) -> bytes:
    """The record's data descriptor (if it has one) with the real CRC-32 filled in."""
    tail = bytes(view[record.data_offset + record.size : record.end])
    if not tail.startswith(_DESCRIPTOR_SIG):
        return tail
    return tail[:4] + struct.pack("<I", crc) + tail[8:]


def _patched_central(view: memoryview, cd_offset: int, n: int, crcs: Mapping[int, int]) -> bytes:
    """The original central directory with each entry's CRC-32 replaced (by header offset)."""
    out = bytearray()
    pos = cd_offset
    for _ in range(n):
        fixed = bytearray(view[pos : pos + _CENTRAL_FIXED])
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", fixed, 28)
        length = _CENTRAL_FIXED + name_len + extra_len + comment_len
        entry = bytearray(view[pos : pos + length])
        header_offset = struct.unpack_from("<I", entry, 42)[0]
        if header_offset == 0xFFFFFFFF:  # zip64: the offset is the extra field's last value
            header_offset = _zip64_offset(bytes(entry[_CENTRAL_FIXED + name_len :][:extra_len]))
        struct.pack_into("<I", entry, 16, crcs[header_offset])
        out += entry
        pos += length
    return bytes(out)


def _zip64_offset(extra: bytes) -> int:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            return int(struct.unpack_from("<Q", extra, pos + 4 + size - 8)[0])
        pos += 4 + size
    raise ValueError("zip64 central entry without an offset")


def stream_archive(
    view: memoryview,
    sink: Sink,
    *,
    path: str,
    expected: Mapping[int, tuple[int, str]] | None = None,
) -> dict[str, int]:
    """Write the persisted form of the archive in ``view`` to ``sink`` in one pass.

    ``expected`` maps record data offsets (in ``view``) to ``(xxh3, tensor name)``:
    a record whose bytes hash differently raises :class:`CorruptCheckpoint` naming the tensor
    (``tier="local"``: the copy being persisted is bad). Returns every record's xxh3.
    """
    records, cd_offset = list_records(view, path)
    digests: dict[str, int] = {}
    crcs: dict[int, int] = {}
    for record in records:
        crc, digest = _stream_record(view, record, sink)
        want = (expected or {}).get(record.data_offset)
        if want is not None and want[0] != digest:
            raise CorruptCheckpoint(
                f"checkpoint {path!r} is corrupt in the local tier: tensor {want[1]!r} has "
                f"digest {digest_hex(digest)}, expected {digest_hex(want[0])}; it was not "
                "persisted",
                tensor=want[1],
                tier="local",
            )
        sink(_descriptor(view, record, crc))
        crcs[record.header_offset] = crc
        digests[record.name] = digest
    member = _digest_member(_top_folder(records), digests, cd_offset)
    sink(member.local)
    central = _patched_central(view, cd_offset, len(records), crcs) + member.central
    new_cd = cd_offset + len(member.local)
    sink(central + end_records(len(records) + 1, new_cd, len(central)))
    return digests


@dataclass(frozen=True)
class _Member:
    local: bytes
    central: bytes


def _digest_member(top: str, digests: Mapping[str, int], offset: int) -> _Member:
    """The digest record (local header + JSON, sizes known up front) and its central entry."""
    body = json.dumps({
        "format": DIGESTS_FORMAT, "algorithm": DIGEST_ALGORITHM,
        "records": {name: digest_hex(d) for name, d in digests.items()},
    }, separators=(",", ":"), sort_keys=True).encode()  # fmt: skip
    name = f"{top}/{DIGESTS_MEMBER}".encode()
    crc = zlib.crc32(body)
    local = _LOCAL.pack(0x04034B50, 20, 0x0800, 0, 0, 0, crc, len(body), len(body), len(name), 0)
    central = central_record(name, offset, len(body), crc=crc, flags=0x0800)
    return _Member(local + name + body, central)


def check_archive(
    view: memoryview,
    path: str,
    *,
    deep: bool = False,
    computed: Mapping[tuple[int, int], tuple[int, int | None]] | None = None,
) -> dict[int, int]:
    """Raise :class:`CorruptCheckpoint` naming ``path`` if the archive is truncated or (with
    ``deep``) any record's bytes differ from its recorded digest or CRC-32. With ``deep``,
    returns the xxh3 of every record by data offset (computed in the checking pass).

    ``computed`` maps ``(data offset, size)`` of records to ``(xxh3, CRC-32 or None)`` already
    computed over these bytes (by a reader that hashed while it read, see
    :mod:`ckptcache.server.archive_read`): those records are compared, not hashed again; a
    record it lacks (or lacks the CRC of, when one is needed) is hashed here."""
    if len(view) == 0:
        raise _corrupt(path, "the file is empty")
    records, _ = list_records(view, path)
    if not deep:
        return {}
    digests = _recorded_digests(view, records, path)
    found: dict[int, int] = {}
    for record in records:
        if record.name.endswith("/" + DIGESTS_MEMBER):
            continue
        data = view[record.data_offset : record.data_offset + record.size]
        known, crc = (computed or {}).get((record.data_offset, record.size), (None, None))
        found[record.data_offset] = got = xxhash.xxh3_64_intdigest(data) if known is None else known
        if digests is not None:
            want = digests.get(record.name)
            if want is None:
                raise _corrupt(path, f"record {record.name!r} is not in the digest record")
            if got != want:
                raise _corrupt(path, f"record {record.name!r} does not match its digest",
                               tensor=record.name)  # fmt: skip
        elif record.crc and (zlib.crc32(data) if crc is None else crc) != record.crc:
            raise _corrupt(path, f"record {record.name!r} does not match its CRC-32",
                           tensor=record.name)  # fmt: skip
    if digests is not None:
        names = {r.name for r in records}
        missing = sorted(set(digests) - names)
        if missing:
            raise _corrupt(path, f"records {missing} are missing")
    return found


def _recorded_digests(
    view: memoryview, records: list[ArchiveRecord], path: str
) -> dict[str, int] | None:
    member = next((r for r in records if r.name.endswith("/" + DIGESTS_MEMBER)), None)
    if member is None:
        return None
    data = bytes(view[member.data_offset : member.data_offset + member.size])
    if zlib.crc32(data) != member.crc:
        raise _corrupt(path, "the digest record does not match its CRC-32")
    try:
        table = json.loads(data)
        if table.get("format") != DIGESTS_FORMAT or table.get("algorithm") != DIGEST_ALGORITHM:
            raise ValueError(f"unknown digest record format {table.get('format')!r}")
        return {str(k): int(v, 16) for k, v in table["records"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _corrupt(path, f"unreadable digest record: {e}") from e


def stored_archive_complete(backend: StorageBackend, path: str) -> bool:
    """Whether the object at ``path`` ends with zip end records (an empty or cut-short file
    does not); reads only the object's last few dozen bytes."""
    size = backend.size(path)

    def read(offset: int, n: int) -> bytes:
        buf = bytearray(n)
        backend.read_into(path, offset, memoryview(buf))
        return bytes(buf)

    try:
        count_records(size, read)
    except (ValueError, struct.error):
        return False
    return True


@contextlib.contextmanager
def _stored_view(path: str) -> Iterator[tuple[memoryview, bytes | None]]:
    """The stored object's bytes: a read-only mapping of a local file, or the whole body of a
    URL's object (also yielded, for ``torch.load`` to read from memory)."""
    if "://" in path:
        with backend_for(path).open_read(path) as f:
            data = f.read()
        yield memoryview(data), data
        return
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise _corrupt(path, "the file is empty")
        mapping = mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_READ)
    view = memoryview(mapping)
    try:
        yield view, None
    finally:
        view.release()
        try:
            mapping.close()
        except BufferError:
            pass  # slices live on in an error's traceback: unmapped when it is collected


def verify_stored(path: str, *, deep: bool = True) -> None:
    """Check the checkpoint stored at ``path``: its structure (truncation) and, with
    ``deep``, every record against the digest record or its CRC-32."""
    with _stored_view(path) as (view, _):
        _check_stored(view, path, deep)


def load_from_storage(
    path: str,
    map_location: Any = None,
    *,
    weights_only: bool = True,
    mmap: bool | None = None,
    verify: bool = False,
) -> Any:
    """``torch.load`` of a stored checkpoint, after :func:`check_archive` (structure always,
    digests with ``verify``); damage raises :class:`CorruptCheckpoint` naming ``path``."""
    import torch

    with _stored_view(path) as (view, data):
        _check_stored(view, path, verify)
    source: Any = path if data is None else io.BytesIO(data)
    kwargs: dict[str, Any] = {"mmap": mmap} if data is None else {}
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only, **kwargs)
    except (EOFError, zipfile.BadZipFile) as e:
        raise _corrupt(path, f"{type(e).__name__}: {e}") from e


def _check_stored(view: memoryview, path: str, deep: bool) -> None:
    if len(view) == 0:
        raise _corrupt(path, "the file is empty")
    if bytes(view[:4]) == b"PK\x03\x04":  # torch.save's zip format (legacy files: torch checks)
        check_archive(view, path, deep=deep)
