"""The proof and the checks of an incremental persist, one piece at a time: which records are
copied, and that a refused copy, a damaged previous file or a damaged memory copy never give
a file that disagrees with the digests."""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch
import xxhash

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.persisted import WrittenRecord, list_records, stream_archive
from ckptcache.server.persist import incremental
from ckptcache.server.persist.incremental import MIN_RECORD, Layouts, PersistedLayout, RecordReuse
from ckptcache.storage.ranges import gapped_stream_fill

MIB = 1 << 20


def _archive(seed: int = 3) -> bytearray:
    g = torch.Generator().manual_seed(seed)
    blob = io.BytesIO()
    state = {f"t{i}": torch.randn(MIB // 4 + 17 * i, generator=g) for i in range(4)}
    state["small"] = torch.randn(10, generator=g)
    torch.save(state, blob)
    return bytearray(blob.getvalue())


def _persist(view: memoryview, path: str, reuse: RecordReuse | None) -> list[WrittenRecord]:
    """Write ``view``'s persisted form to ``path`` (through ``reuse`` if given)."""
    written: list[WrittenRecord] = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    source = os.open(path + ".prev", os.O_RDONLY) if reuse is not None else None
    try:
        if reuse is None:
            stream_archive(view, lambda piece: _write_all(fd, piece), path=path, written=written)
        else:
            reuse.attach(source)

            def produce(sink, skip):
                stream_archive(view, sink, path=path, written=written, reuse=reuse.plan,
                               skip=skip)  # fmt: skip

            gapped_stream_fill(produce, reuse.finish)(fd)
    finally:
        os.close(fd)
        if source is not None:
            os.close(source)
    return written


def _write_all(fd: int, piece) -> None:
    view = memoryview(piece)
    while view:
        view = view[os.write(fd, view) :]


def _expected(view: memoryview) -> dict[int, tuple[int, str]]:
    records, _ = list_records(view)
    return {
        r.data_offset: (xxhash.xxh3_64_intdigest(view[r.data_offset : r.data_offset + r.size]),
                        r.name)
        for r in records if "/data/" in r.name
    }  # fmt: skip


@pytest.fixture
def previous(tmp_path):
    """A first persist of an archive: its path, the file's layout and the archive."""
    data = _archive()
    path = str(tmp_path / "m.pt")
    written = _persist(memoryview(data), path + ".prev", None)
    st = os.stat(path + ".prev")
    identity = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    return path, PersistedLayout.of(identity, written), data


def test_unchanged_records_are_copied_and_the_file_is_the_plain_one(previous):
    path, layout, data = previous
    view = memoryview(data)
    reuse = RecordReuse(layout, _expected(view), view, path)
    assert reuse.candidates()
    _persist(view, path, reuse)
    assert reuse.copied > 3 * MIB and reuse.rewritten == 0
    with open(path, "rb") as f, open(path + ".prev", "rb") as g:
        assert f.read() == g.read()


def test_a_file_not_the_one_recorded_is_not_used(previous):
    path, layout, data = previous
    view = memoryview(data)
    stale = PersistedLayout(layout.identity + "0", layout.records)
    reuse = RecordReuse(stale, _expected(view), view, path)
    _persist(view, path, reuse)
    assert reuse.source is None and reuse.copied == 0


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EIO, errno.ENODATA])
def test_a_failed_copy_is_written_from_memory(previous, monkeypatch, code):
    """Refused (another file system), the previous file unreadable, or cut short."""
    path, layout, data = previous

    def refuse(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(incremental, "copy_range", refuse)
    view = memoryview(data)
    reuse = RecordReuse(layout, _expected(view), view, path)
    _persist(view, path, reuse)
    assert reuse.copied == 0 and reuse.rewritten > 3 * MIB
    with open(path, "rb") as f, open(path + ".prev", "rb") as g:
        assert f.read() == g.read()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_without_a_way_to_read_back_nothing_is_copied(previous, monkeypatch):
    path, layout, data = previous
    real_open = os.open

    def no_proc(name, *args, **kwargs):
        if str(name).startswith("/proc/self/fd/"):
            raise FileNotFoundError(name)
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(incremental.os, "open", no_proc)
    view = memoryview(data)
    reuse = RecordReuse(layout, _expected(view), view, path)
    _persist(view, path, reuse)
    assert reuse.copied == 0 and reuse.rewritten > 3 * MIB
    assert _read(path) == _read(path + ".prev")


def _flip(path: str, offset: int) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # looks untouched


def test_damage_in_the_previous_file_is_written_from_memory(previous):
    path, layout, data = previous
    before = _read(path + ".prev")
    records, _ = list_records(memoryview(before))
    target = next(r for r in records if r.size >= MIN_RECORD)
    _flip(path + ".prev", target.data_offset + 5000)
    damaged = _read(path + ".prev")
    view = memoryview(data)
    reuse = RecordReuse(layout, _expected(view), view, path)
    _persist(view, path, reuse)
    assert reuse.rewritten > 0
    assert _read(path) == before  # what memory holds, not the damage
    assert _read(path + ".prev") == damaged  # only read


def test_damage_in_both_the_previous_file_and_memory_fails_typed(previous):
    path, layout, data = previous
    records, _ = list_records(memoryview(bytes(data)))
    target = next(r for r in records if r.size >= MIN_RECORD)
    view = memoryview(data)
    expected = _expected(view)  # the digests taken at commit
    _flip(path + ".prev", target.data_offset + 5000)
    data[target.data_offset + 6000] ^= 0x01  # memory changed after its digest was taken
    reuse = RecordReuse(layout, expected, view, path)
    with pytest.raises(CorruptCheckpoint, match="local tier"):
        _persist(view, path, reuse)


def test_layouts_are_bounded():
    layouts = Layouts(paths=2, records=100)
    one = PersistedLayout("i", {(1, MIB): (0, 0)})
    for n in range(3):
        layouts.put(("ns", f"/p{n}"), one)
    assert layouts.get(("ns", "/p0")) is None and layouts.get(("ns", "/p2")) is one
    layouts.put(("ns", "/p2"), None)  # forgotten
    assert layouts.get(("ns", "/p2")) is None
