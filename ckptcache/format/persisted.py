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
  holding the xxh3 of every other record (skeleton, storages, small records) and, under
  ``"meta"``, the xxh3 of the zip structure around them (local headers, data descriptors, the
  central directory entries of those records). ``torch.load`` ignores records it does not look
  up, so the file stays an ordinary checkpoint.

So every byte of a persisted file is covered: a record's data by its digest, the structure by
the ``meta`` digest, and the digest record's own headers and the end records are what this
module writes for that content, compared byte for byte (:func:`check_archive` with ``deep``).

:func:`check_archive` is the reader's side: a cheap structural check (end records, central
directory, every record inside the file: catches truncation) and, with ``deep=True``, every
record's digest (or its CRC-32 for archives without the digest record, e.g. ``torch.save``'s)
and the structure. :func:`read_verified` reads a stored file into memory with those checks made
while the bytes arrive; :func:`load_from_storage` builds the object over them.
"""

from __future__ import annotations

import contextlib
import json
import mmap as mmap_module
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive import central_record, count_records, end_records
from ckptcache.format.crc import crc32
from ckptcache.format.digest import DIGEST_ALGORITHM, digest_hex
from ckptcache.format.names import storage_names
from ckptcache.format.zip_records import (
    ArchiveRecord,
    central_offset,
    list_records,
    storage_corrupt,
)
from ckptcache.storage import StorageBackend, backend_for

__all__ = [
    "DIGESTS_FORMAT",
    "DIGESTS_MEMBER",
    "ArchiveRecord",
    "CopiedRange",
    "WrittenRecord",
    "central_offset",
    "check_archive",
    "check_stored",
    "lead_digest",
    "list_records",
    "storage_corrupt",
    "stored_archive_complete",
    "stored_view",
    "stream_archive",
    "verify_stored",
    "zip_marks",
]

#: Name of the digest record, relative to the archive's top folder.
DIGESTS_MEMBER = ".ckptcache/digests.json"
#: Version of the digest record's JSON; a reader refuses versions it does not know.
DIGESTS_FORMAT = 1

_CHUNK = 8 << 20  # write granule
#: Hash granule: the CRC-32 and the xxh3 read a chunk in turn, the second from the CPU's
#: cache where the chunk fits its L2, and the memory bus the disk's DMA shares is read
#: once.
_HASH_CHUNK = 1 << 20
#: Runs of records hashed ahead of the writes.
_AHEAD = 2
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_FIXED = 46
_DESCRIPTOR_SIG = b"PK\x07\x08"
#: Bytes of the end records :func:`~ckptcache.format.archive.end_records` writes (zip64 end
#: record, its locator, end of central directory): how every persisted archive ends.
_END_SIZE = 56 + 20 + 22
#: Reader threads of :func:`read_verified` (ranged reads, CRC-32s in parallel).

Sink = Callable[[memoryview | bytes], None]
#: Passes over the next ``n`` bytes of the output without writing them (someone else fills
#: them before the object is complete).
Skip = Callable[[int], None]


class CopiedRange(NamedTuple):
    """The part ``[start, end)`` of a record's data that is not streamed: the caller fills it
    in the output (a copy from an earlier file) and checks the whole record there before the
    object becomes visible. ``digest`` and ``crc`` are those of the whole record, for the
    descriptor and the digest record."""

    start: int
    end: int
    digest: int
    crc: int


class WrittenRecord(NamedTuple):
    """One record as the stream wrote it: where its data lies in the output (the same offset
    as in the view: the output mirrors the archive up to its central directory), the xxh3
    and CRC-32 of that data, and ``lead``, the xxh3 of the bytes written between the previous
    record's data and this one's (:func:`lead_digest`)."""

    name: str
    data_offset: int
    size: int
    digest: int
    crc: int
    lead: int


#: Chooses, from the archive's records, those whose data is copied rather than streamed
#: (by data offset).
Reuse = Callable[[list[ArchiveRecord]], Mapping[int, CopiedRange]]


def _top_folder(records: list[ArchiveRecord]) -> str:
    return records[0].name.split("/", 1)[0] if records else "archive"


def _hash_records(
    view: memoryview, records: list[ArchiveRecord], copied: Mapping[int, CopiedRange]
) -> list[tuple[int, int]]:
    """Each record's (CRC-32, xxh3), both taken chunk by chunk while the chunk is in cache
    (zlib and xxhash release the interpreter lock: this runs beside the writes). A copied
    record is not read: its values are the copy's (checked where it lands)."""
    out = []
    for record in records:
        reused = copied.get(record.data_offset)
        if reused is not None:
            out.append((reused.crc, reused.digest))
            continue
        crc = 0
        hasher = xxhash.xxh3_64()
        end = record.data_offset + record.size
        for start in range(record.data_offset, end, _HASH_CHUNK):
            chunk = view[start : min(start + _HASH_CHUNK, end)]
            crc = crc32(chunk, crc)
            hasher.update(chunk)
        out.append((crc, hasher.intdigest()))
    return out


def _batches(records: list[ArchiveRecord]) -> list[list[ArchiveRecord]]:
    """Records in runs of about :data:`_CHUNK` bytes (a large record is a run of its own)."""
    batches: list[list[ArchiveRecord]] = [[]]
    size = 0
    for record in records:
        if size >= _CHUNK:
            batches.append([])
            size = 0
        batches[-1].append(record)
        size += record.end - record.header_offset
    return batches


def _descriptor(view: memoryview, record: ArchiveRecord, crc: int) -> bytes:
    """The record's data descriptor (if it has one) with the real CRC-32 filled in."""
    tail = bytes(view[record.data_offset + record.size : record.end])
    if not tail.startswith(_DESCRIPTOR_SIG):
        return tail
    return tail[:4] + struct.pack("<I", crc) + tail[8:]


def lead_digest(
    view: memoryview, previous: ArchiveRecord | None, previous_crc: int, record: ArchiveRecord
) -> int:
    """The xxh3 of the bytes a persisted archive holds between the data of ``previous`` (None:
    ``record`` is the first) and the data of ``record``: the previous record's descriptor
    with its real CRC-32, then ``record``'s local header. Two files whose records agree in
    data and in these digests agree byte for byte over the run."""
    tail = b"" if previous is None else _descriptor(view, previous, previous_crc)
    return _lead(tail, view[record.header_offset : record.data_offset])


def _lead(tail: bytes, header: memoryview) -> int:
    """:func:`lead_digest` of a record given the descriptor written before its header."""
    return xxhash.xxh3_64_intdigest(tail + bytes(header))


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
    offsets: dict[int, int] | None = None,
    reuse: Reuse | None = None,
    skip: Skip | None = None,
    written: list[WrittenRecord] | None = None,
) -> dict[str, int]:
    """Write the persisted form of the archive in ``view`` to ``sink`` in one pass.

    ``sink`` gets the pieces as they lie (a record's header, its data in runs of at most
    8 MiB, its descriptor): a sink that writes small pieces at a cost per call gathers them
    itself (:class:`~ckptcache.storage.handoff.Gather`; the direct writer copies them into its
    bounce buffers anyway, so a second gathering copy here would be waste).

    ``expected`` maps record data offsets (in ``view``) to ``(xxh3, tensor name)``:
    a record whose bytes hash differently raises :class:`CorruptCheckpoint` naming the tensor
    (``tier="local"``: the copy being persisted is bad). Returns every record's xxh3 by name;
    ``offsets``, if given, receives them by data offset as well; ``written``, if given, every
    record as :class:`WrittenRecord`.

    ``reuse`` (with ``skip``) picks records whose data is not streamed: for each
    :class:`CopiedRange` it returns, the stream writes the record's bytes before ``start``
    and from ``end`` on, and calls ``skip(end - start)`` for the rest, which the caller fills
    and checks (the output is then the same file as without ``reuse``).
    """
    records, cd_offset = list_records(view, path)
    copied: Mapping[int, CopiedRange] = {}
    if reuse is not None:
        assert skip is not None, "a stream that reuses records needs a skip"
        copied = reuse(records)
    digests: dict[str, int] = {}
    crcs: dict[int, int] = {}
    meta = xxhash.xxh3_64()  # the structure around the records: a few bytes per record
    batches = _batches(records)
    tail = b""  # the descriptor written last (before the next record's header)
    # The CRC-32s and digests of the next runs of records are taken on a second thread while
    # this one writes (the write needs a record's CRC only for its descriptor, after its
    # data): the persist costs the larger of the two, not their sum.
    with ThreadPoolExecutor(1, thread_name_prefix="ckptcache-crc") as hasher:
        ahead = [hasher.submit(_hash_records, view, b, copied) for b in batches[:_AHEAD]]
        try:
            for n, batch in enumerate(batches):
                if n + _AHEAD < len(batches):
                    ahead.append(hasher.submit(_hash_records, view, batches[n + _AHEAD], copied))
                hashed = ahead[n].result()
                for record, (crc, digest) in zip(batch, hashed, strict=True):
                    meta.update(view[record.header_offset : record.data_offset])
                    sink(view[record.header_offset : record.data_offset])
                    data_end = record.data_offset + record.size
                    reused = copied.get(record.data_offset)
                    if reused is None:
                        _data(view, sink, record.data_offset, data_end)
                    else:  # the edges from memory, the aligned middle filled by the caller
                        assert skip is not None
                        _data(view, sink, record.data_offset, reused.start)
                        skip(reused.end - reused.start)
                        _data(view, sink, reused.end, data_end)
                    want = (expected or {}).get(record.data_offset)
                    if want is not None and want[0] != digest:
                        raise CorruptCheckpoint(
                            f"checkpoint {path!r} is corrupt in the local tier: tensor "
                            f"{want[1]!r} has digest {digest_hex(digest)}, expected "
                            f"{digest_hex(want[0])}; it was not persisted",
                            tensor=want[1],
                            tier="local",
                        )
                    descriptor = _descriptor(view, record, crc)
                    meta.update(descriptor)
                    sink(descriptor)
                    crcs[record.header_offset] = crc
                    digests[record.name] = digest
                    if offsets is not None:
                        offsets[record.data_offset] = digest
                    if written is not None:
                        lead = _lead(tail, view[record.header_offset : record.data_offset])
                        written.append(WrittenRecord(
                            record.name, record.data_offset, record.size, digest, crc, lead
                        ))  # fmt: skip
                    tail = descriptor
        finally:
            for future in ahead:
                future.cancel()
    original_central = _patched_central(view, cd_offset, len(records), crcs)
    meta.update(original_central)
    member = _member(_top_folder(records), _digest_body(digests, meta.intdigest()), cd_offset)
    sink(member.local)
    central = original_central + member.central
    new_cd = cd_offset + len(member.local)
    sink(central + end_records(len(records) + 1, new_cd, len(central)))
    return digests


def _data(view: memoryview, sink: Sink, start: int, end: int) -> None:
    """``view[start:end]`` to ``sink`` in pieces of at most :data:`_CHUNK` bytes."""
    for at in range(start, end, _CHUNK):
        sink(view[at : min(at + _CHUNK, end)])


@dataclass(frozen=True)
class _Member:
    local: bytes
    central: bytes


def _digest_body(digests: Mapping[str, int], meta: int) -> bytes:
    """The digest record's JSON: every record's xxh3, and ``meta`` (the structure's)."""
    return json.dumps({
        "format": DIGESTS_FORMAT, "algorithm": DIGEST_ALGORITHM, "meta": digest_hex(meta),
        "records": {name: digest_hex(d) for name, d in digests.items()},
    }, separators=(",", ":"), sort_keys=True).encode()  # fmt: skip


def _member(top: str, body: bytes, offset: int) -> _Member:
    """The digest record at ``offset`` (local header + ``body``, sizes known up front) and
    its central entry."""
    name = f"{top}/{DIGESTS_MEMBER}".encode()
    crc = crc32(body)
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
    ``deep``) any record's bytes differ from its recorded digest or CRC-32, or (archives this
    module wrote) any byte of the zip structure changed. With ``deep``, returns the xxh3 of
    every record by data offset (computed in the checking pass). A damaged tensor is named by
    its state-dict path (read from the skeleton, which is checked first: it comes first).

    ``computed`` maps ``(data offset, size)`` of records to ``(xxh3, CRC-32 or None)`` already
    computed over these bytes (by a reader that hashed while it read, see
    :mod:`ckptcache.format.archive_read`): those records are compared, not hashed again; a
    record it lacks (or lacks the CRC of, when one is needed) is hashed here."""
    if len(view) == 0:
        raise storage_corrupt(path, "the file is empty")
    records, cd_offset = list_records(view, path)
    if not deep:
        return {}
    member = next((r for r in records if r.name.endswith("/" + DIGESTS_MEMBER)), None)
    table = _recorded_table(view, member, path) if member is not None else None
    digests = table.records if table is not None else None
    found: dict[int, int] = {}
    for record in records:
        if record is member:
            continue
        data = view[record.data_offset : record.data_offset + record.size]
        known, crc = (computed or {}).get((record.data_offset, record.size), (None, None))
        found[record.data_offset] = got = xxhash.xxh3_64_intdigest(data) if known is None else known
        if digests is not None:
            want = digests.get(record.name)
            if want is None:
                raise storage_corrupt(path, f"record {record.name!r} is not in the digest record")
            if got != want:
                raise _record_corrupt(view, records, record, path, "digest")
        elif record.crc and (crc32(data) if crc is None else crc) != record.crc:
            raise _record_corrupt(view, records, record, path, "CRC-32")
    if digests is not None:
        names = {r.name for r in records}
        missing = sorted(set(digests) - names)
        if missing:
            raise storage_corrupt(path, f"records {missing} are missing")
    if table is not None and table.meta is not None:
        assert member is not None
        _check_structure(view, records, member, cd_offset, table.meta, path)
    return found


def _record_corrupt(
    view: memoryview, records: list[ArchiveRecord], record: ArchiveRecord, path: str, check: str
) -> CorruptCheckpoint:
    """The error for a record whose bytes do not match its ``check`` (digest or CRC-32),
    naming the tensor it holds where the skeleton says which."""
    name = record.name.split("/", 1)[-1]
    if name == "data.pkl":
        what, tensor = f"the pickle skeleton (record {record.name!r})", "<skeleton>"
    elif name.startswith("data/"):
        key = name[len("data/") :]
        tensor = _tensor_names(view, records).get(key, f"<storage {key}>")
        what = f"tensor {tensor!r} (record {record.name!r})"
    else:
        what, tensor = f"record {record.name!r}", None
    return storage_corrupt(path, f"{what} does not match its {check}", tensor=tensor)


def _tensor_names(view: memoryview, records: list[ArchiveRecord]) -> dict[str, str]:
    """Storage key -> tensor name, from the archive's skeleton (on the error path only)."""
    top = _top_folder(records)
    skeleton = next((r for r in records if r.name == f"{top}/data.pkl"), None)
    if skeleton is None:
        return {}
    return storage_names(view[skeleton.data_offset : skeleton.data_offset + skeleton.size])


def _check_structure(
    view: memoryview,
    records: list[ArchiveRecord],
    member: ArchiveRecord,
    cd_offset: int,
    meta: int,
    path: str,
) -> None:
    """Every byte that is not a record's data, against what :func:`stream_archive` wrote: the
    original records' local headers, descriptors and central entries by the ``meta`` digest;
    the digest record's own headers and the end records rebuilt and compared."""
    size = len(view)
    top = member.name[: -len(DIGESTS_MEMBER) - 1]
    body = view[member.data_offset : member.data_offset + member.size]
    rebuilt = _member(top, bytes(body), member.header_offset)
    central_end = size - _END_SIZE
    member_central = central_end - len(rebuilt.central)
    if records[-1] is not member or member_central < cd_offset:
        raise storage_corrupt(path, "the digest record is not where it was written")
    expected_end = end_records(len(records), cd_offset, central_end - cd_offset)
    if bytes(view[member.header_offset : member.data_offset + member.size]) != rebuilt.local:
        raise storage_corrupt(path, "the digest record's local header was changed")
    if bytes(view[member_central:central_end]) != rebuilt.central:
        raise storage_corrupt(path, "the digest record's central directory entry was changed")
    if bytes(view[central_end:]) != expected_end:
        raise storage_corrupt(path, "the zip end records were changed")
    hasher = xxhash.xxh3_64()
    for record in records[:-1]:
        hasher.update(view[record.header_offset : record.data_offset])
        hasher.update(view[record.data_offset + record.size : record.end])
    hasher.update(view[cd_offset:member_central])
    if hasher.intdigest() != meta:
        raise storage_corrupt(path, "the zip structure (local headers, data descriptors or central "
                             "directory) does not match its digest")  # fmt: skip


@dataclass(frozen=True)
class _DigestTable:
    """The digest record's content: every record's xxh3 by name, and the structure's
    (None in files written before it was recorded)."""

    records: dict[str, int]
    meta: int | None


def _recorded_table(view: memoryview, member: ArchiveRecord, path: str) -> _DigestTable:
    data = bytes(view[member.data_offset : member.data_offset + member.size])
    if crc32(data) != member.crc:
        raise storage_corrupt(path, "the digest record does not match its CRC-32")
    try:
        table = json.loads(data)
        if table.get("format") != DIGESTS_FORMAT or table.get("algorithm") != DIGEST_ALGORITHM:
            raise ValueError(f"unknown digest record format {table.get('format')!r}")
        records = {str(k): int(v, 16) for k, v in table["records"].items()}
        meta = table.get("meta")
        return _DigestTable(records, None if meta is None else int(meta, 16))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise storage_corrupt(path, f"unreadable digest record: {e}") from e


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
def stored_view(path: str) -> Iterator[tuple[memoryview, bytes | None]]:
    """The stored object's bytes: a read-only mapping of a local file, or the whole body of a
    URL's object (also yielded, for ``torch.load`` to read from memory)."""
    if "://" in path:
        with backend_for(path).open_read(path) as f:
            data = f.read()
        yield memoryview(data), data
        return
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise storage_corrupt(path, "the file is empty")
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
    with stored_view(path) as (view, _):
        check_stored(view, path, deep)


def zip_marks(head: bytes, tail: bytes) -> bool:
    """Whether an object's first and last bytes are those of a zip archive, or of one cut
    inside its first four bytes (a legacy pickle never starts with ``P``: it starts with its
    protocol's opcode): such a file is a truncated archive, never a legacy one for torch's
    unpickler to fail on."""
    if head[:4] == b"PK\x03\x04" or (len(tail) == 22 and tail[:4] == b"PK\x05\x06"):
        return True
    return 0 < len(head) < 4 and b"PK\x03\x04".startswith(head)


def check_stored(view: memoryview, path: str, deep: bool) -> None:
    """:func:`check_archive` for a stored object; one that is no zip archive (a legacy
    ``torch.save`` file) is left to torch's own checks."""
    if len(view) == 0:
        raise storage_corrupt(path, "the file is empty")
    if zip_marks(bytes(view[:4]), bytes(view[-22:])):  # legacy files: torch checks
        check_archive(view, path, deep=deep)
