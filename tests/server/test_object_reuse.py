"""Incremental persists to S3, one piece at a time, against a real S3 endpoint (moto's server
over HTTP): the ranges copied from the previous object give the object a full upload gives,
and a replaced object or damaged memory never give one that disagrees with the digests."""

from __future__ import annotations

import io

import pytest
import torch

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.persisted import WrittenRecord, list_records, stream_archive
from ckptcache.server.persist.incremental import PersistedLayout
from ckptcache.server.persist.object_reuse import ObjectReuse
from ckptcache.storage.base import StorageOptions
from ckptcache.storage.s3 import S3Backend
from tests.server.test_incremental_reuse import _expected

MIB = 1 << 20
PART = 5 * MIB


def _state(step: int) -> dict[str, torch.Tensor]:
    """A LoRA-like state: frozen 6 MiB base tensors with a small adapter after each that
    changes every step."""
    base = torch.Generator().manual_seed(11)
    changing = torch.Generator().manual_seed(100 + step)
    state: dict[str, torch.Tensor] = {}
    for i in range(6):
        state[f"layer{i}.base"] = torch.randn(6 * MIB // 4, generator=base)
        state[f"layer{i}.lora"] = torch.randn(16 << 10, generator=changing)
    state["head"] = torch.randn(20 * MIB // 4, generator=base)  # frozen, large
    return state


def _adapter_bytes(step: int) -> bytes:
    """The last adapter of step ``step``, as the archive holds it."""
    return _state(step)["layer5.lora"].numpy().tobytes()


def _archive(step: int) -> bytearray:
    blob = io.BytesIO()
    torch.save(_state(step), blob)
    return bytearray(blob.getvalue())


def _full(view: memoryview) -> bytes:
    out = bytearray()
    stream_archive(view, out.extend, path="m.pt")
    return bytes(out)


@pytest.fixture
def backend(s3_server, s3_bucket):
    opts = StorageOptions(s3_endpoint_url=s3_server.endpoint, s3_part_size=PART)
    return S3Backend(opts), f"s3://{s3_bucket}/run/m.pt"


def _first(backend: S3Backend, path: str) -> PersistedLayout:
    """Upload step 0 in full; the layout the daemon keeps of it."""
    view = memoryview(_archive(0))
    written: list[WrittenRecord] = []
    backend.write_stream(path, lambda sink: stream_archive(view, sink, path=path,
                                                          written=written))  # fmt: skip
    version = backend.version(path)
    assert version is not None
    return PersistedLayout.of(version.identity, written, placed=True)


def _spliced(backend: S3Backend, path: str, reuse: ObjectReuse, view: memoryview) -> None:
    def produce(sink, skip):
        stream_archive(view, sink, path=path, expected=reuse.expected, reuse=reuse.plan,
                       skip=skip)  # fmt: skip

    backend.write_spliced(path, produce, reuse.copies, token=reuse.token)


def _stored(backend: S3Backend, path: str) -> bytes:
    return backend.open_read(path).read()


def test_copied_ranges_give_the_object_a_full_upload_gives(backend):
    backend, path = backend
    layout = _first(backend, path)
    data = _archive(1)
    view = memoryview(data)
    reuse = ObjectReuse(layout, _expected(view), view, path, part_size=PART)
    assert reuse.prepare(backend.version(path))
    _spliced(backend, path, reuse, view)
    assert _stored(backend, path) == _full(view)
    # The frozen tensors, less what the part rules upload around each changed adapter.
    assert reuse.copied >= 20 * MIB
    assert reuse.copied <= sum(end - start for start, end in reuse.copies)


def test_an_object_replaced_since_is_not_copied_from(backend):
    backend, path = backend
    layout = _first(backend, path)
    backend.write_bytes(path, _full(memoryview(_archive(0))))  # same bytes, another object
    view = memoryview(_archive(1))
    reuse = ObjectReuse(layout, _expected(view), view, path, part_size=PART)
    assert not reuse.prepare(backend.version(path))
    assert reuse.copies == [] and not reuse.token


def test_bytes_between_records_unlike_the_previous_objects_are_uploaded(backend):
    """Two frozen records in a row, but the previous object held other bytes between them
    (its recorded lead differs): the copy stops before those bytes, which are uploaded."""
    backend, path = backend
    layout = _first(backend, path)
    view = memoryview(_archive(1))
    records, _ = list_records(view)
    head = next(r for r in records if r.name.endswith("/data/12"))
    # Make the adapter before the head frozen too: one run of two records, then doctor the
    # head's recorded lead.
    expected = _expected(view)
    adapter = next(r for r in records if r.name.endswith("/data/11"))
    old = layout.placed[adapter.data_offset]
    expected[adapter.data_offset] = (old.digest, expected[adapter.data_offset][1])
    view_bytes = bytearray(view)
    view_bytes[adapter.data_offset : adapter.data_offset + adapter.size] = _adapter_bytes(0)
    view = memoryview(view_bytes)
    placed = dict(layout.placed)
    placed[head.data_offset] = placed[head.data_offset]._replace(lead=12345)
    doctored = PersistedLayout(layout.identity, {}, placed)
    reuse = ObjectReuse(doctored, expected, view, path, part_size=PART)
    assert reuse.prepare(backend.version(path))
    assert not any(s < head.data_offset and e > adapter.data_offset + adapter.size
                   for s, e in reuse.copies), "no copy spans the doctored header"  # fmt: skip
    _spliced(backend, path, reuse, view)
    assert _stored(backend, path) == _full(view)


def test_memory_damaged_where_a_copy_is_cut_fails_before_anything_is_visible(backend):
    backend, path = backend
    layout = _first(backend, path)
    before = _stored(backend, path)
    data = _archive(1)
    view = memoryview(data)
    expected = _expected(view)
    reuse = ObjectReuse(layout, expected, view, path, part_size=PART)
    records, _ = list_records(view)
    assert reuse.prepare(backend.version(path))
    starts = [start for start, _ in reuse.copies]
    cut = [r for r in records if any(r.data_offset < s < r.data_offset + r.size for s in starts)]
    assert cut, "a copy starts inside a record (after an adapter uploaded before it)"
    data[cut[0].data_offset] ^= 0x40  # memory differs from the digest taken at commit
    fresh = ObjectReuse(layout, expected, view, path, part_size=PART)
    with pytest.raises(CorruptCheckpoint, match="corrupt in the local tier"):
        fresh.prepare(backend.version(path))
    assert _stored(backend, path) == before


def test_an_object_replaced_before_the_copies_fails_them(backend):
    """Each copy names the ETag the ranges were proven against: S3 refuses it (412) once
    another object is at the key, and nothing becomes visible."""
    backend, path = backend
    layout = _first(backend, path)
    view = memoryview(_archive(1))
    reuse = ObjectReuse(layout, _expected(view), view, path, part_size=PART)
    assert reuse.prepare(backend.version(path))
    other = _full(memoryview(_archive(7)))
    backend.write_bytes(path, other)
    with pytest.raises(OSError, match="changed while it was written"):
        _spliced(backend, path, reuse, view)
    assert _stored(backend, path) == other


def test_an_object_replaced_during_the_upload_fails_it(backend):
    backend, path = backend
    layout = _first(backend, path)
    view = memoryview(_archive(1))
    reuse = ObjectReuse(layout, _expected(view), view, path, part_size=PART)
    assert reuse.prepare(backend.version(path))
    other = _full(memoryview(_archive(7)))

    def produce(sink, skip):
        stream_archive(view, sink, path=path, expected=reuse.expected, reuse=reuse.plan,
                       skip=skip)  # fmt: skip
        backend.write_bytes(path, other)  # another writer, after the copies were made

    with pytest.raises(OSError, match="was replaced during the upload"):
        backend.write_spliced(path, produce, reuse.copies, token=reuse.token)
    assert _stored(backend, path) == other
    bucket, _key = path[5:].split("/", 1)
    assert backend.client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
