"""``ckptcache.open``: files a tool reads right after a save, from the daemon's memory while the
file does not exist yet, else from storage. Real daemons; the frameworks' own readers."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

import ckptcache
import ckptcache.adapters.dcp as cdcp
from tests.helpers import assert_same, read_only_dir, wait_until


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "step": seed, "ids": torch.arange(seed, 99)}


def records(data: bytes) -> dict[str, bytes]:
    """Every zip record's local header and data, by name (not its CRC-32 descriptor)."""
    out = {}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            start = info.header_offset
            name_len, extra_len = struct.unpack_from("<HH", data, start + 26)
            end = start + 30 + name_len + extra_len + info.compress_size
            out[info.filename] = data[start:end]
    return out


def test_memory_only_object_reads_as_its_file(client, tmp_path):
    """No persist root: the file never appears, ``open`` serves it from memory."""
    path = tmp_path / "model.pt"
    sd = state(1)
    client.save(sd, path)
    assert not path.exists() and ckptcache.exists(path)
    with ckptcache.open(path) as f:
        assert isinstance(f, ckptcache.CachedFile)
        assert f.name == str(path) and f.readable() and f.seekable() and not f.writable()
        assert_same(torch.load(f, weights_only=True), sd)
        f.seek(0)
        data = f.read()
        assert len(data) == f.size == client.status(path).size
        assert f.seek(0, io.SEEK_END) == f.size
    assert f.closed
    assert_same(torch.load(io.BytesIO(data), weights_only=True), sd)
    # The segment is released with the view (the next request flushes the release).
    wait_until(lambda: client.status(path).pins == 0, 30, "the view's pin to be released")


def test_view_bytes_are_the_persisted_records(daemon_factory, tmp_path, monkeypatch):
    """Before persistence: the view; after: the file, whose records are the view's bytes at
    the same offsets (the file adds CRC-32s and the digest record)."""
    root = tmp_path / "ck"
    root.mkdir()
    d = daemon_factory("--persist-root", str(root))
    monkeypatch.setenv("CKPTCACHE_SOCKET", d.socket)
    c = d.client()
    ckptcache.api.set_default_client(c)
    try:
        path = root / "model.pt"
        with read_only_dir(root):  # the daemon cannot persist yet
            c.save(state(2), path)
            assert "persisted" not in c.status(path).stages
            with ckptcache.open(path) as f:
                assert isinstance(f, ckptcache.CachedFile)
                view = f.read()
        c.wait(path)
        with ckptcache.open(path) as f:
            assert not isinstance(f, ckptcache.CachedFile)  # persisted: the file itself
            assert f.name == str(path)
            stored = f.read()
        assert stored == path.read_bytes()
        mine, theirs = records(view), records(stored)
        assert set(theirs) - set(mine) == {"archive/.ckptcache/digests.json"}
        for name, raw in mine.items():
            assert theirs[name] == raw, name
        assert_same(torch.load(path, weights_only=True), state(2))
    finally:
        ckptcache.api.set_default_client(None)
        c.close()


def test_view_pins_its_generation(client, tmp_path):
    path = tmp_path / "model.pt"
    client.save(state(3), path)
    f = ckptcache.open(path)
    client.save(state(4), path)  # a newer generation while the view is open
    assert_same(torch.load(f, weights_only=True), state(3))
    f.close()
    with ckptcache.open(path) as g:
        assert g.generation > f.generation
        assert_same(torch.load(g, weights_only=True), state(4))


def test_stock_dcp_reader_offsets_work_through_open(client, tmp_path):
    """A DCP tool that reads an item at (file, offset, length) from ``.metadata`` works on the
    cached rank file before it exists."""
    sd = {"a": torch.randn(16, 8), "b": torch.arange(40)}
    dcp.save(sd, storage_writer=cdcp.CacheWriter(tmp_path, commit_waits="local"))
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    for fqn, tensor in sd.items():
        info = md.storage_data[MetadataIndex(fqn, (0,) * tensor.dim())]
        assert not (tmp_path / info.relative_path).exists()
        with ckptcache.open(tmp_path / info.relative_path) as f:
            f.seek(info.offset)
            item = f.read(info.length)
        assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), tensor), fqn


def test_plain_files_and_missing_paths(client, tmp_path):
    plain = tmp_path / "plain.pt"
    torch.save(state(5), plain)
    with ckptcache.open(plain) as f:  # never cached: the file
        assert isinstance(f, io.BufferedReader) and f.read() == plain.read_bytes()
    with pytest.raises(ckptcache.CheckpointNotFound, match="neither in the memory") as e:
        ckptcache.open(tmp_path / "absent.pt")
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(ValueError, match="mode must be 'rb', not 'wb'"):
        ckptcache.open(plain, "wb")


def test_without_a_daemon_open_reads_storage(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTCACHE_SOCKET", str(tmp_path / "no-daemon.sock"))
    ckptcache.api.set_default_client(None)
    try:
        plain = tmp_path / "plain.pt"
        torch.save(state(6), plain)
        with ckptcache.open(Path(plain)) as f:
            assert_same(torch.load(f, weights_only=True), state(6))
    finally:
        ckptcache.api.set_default_client(None)
