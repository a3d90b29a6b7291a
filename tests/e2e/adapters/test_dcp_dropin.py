"""DCP with the cache as a drop-in, written the way DCP's own tests are: save into a temporary
directory, read it back with DCP's own tools, delete the directory. One process, no process
group (DCP's no-dist path), a real daemon."""

from __future__ import annotations

import inspect
import io
import shutil
import zipfile
from typing import IO

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException

import ckptcache
import ckptcache.adapters.dcp as cdcp
from tests.helpers import assert_same

pytest.importorskip("torch.distributed.checkpoint")

MiB = 2**20


def state(seed: int, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.weight": torch.randn(8, 4, generator=g) for i in range(n)},
        "bias": torch.arange(10, dtype=torch.int64) + seed,
        "extra": {"step": seed, "note": f"run{seed}"},
    }


def empty_like(sd: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "bias": torch.zeros_like(sd["bias"]),
        "extra": {"step": -1, "note": ""},
    }


@pytest.fixture
def dcp_enabled(client):
    cdcp.enable()
    yield client
    cdcp.disable()


@pytest.fixture
def persisting_client(daemon_factory, tmp_path, monkeypatch):
    d = daemon_factory("--persist-root", str(tmp_path), "--memory-limit", "1GiB")
    monkeypatch.setenv("CKPTCACHE_SOCKET", d.socket)
    c = d.client()
    ckptcache.api.set_default_client(c)
    yield c
    ckptcache.api.set_default_client(None)


class Xor(StreamTransformExtension):
    """A stream transform (like DCP's ZStandard extension) that flips every byte."""

    @staticmethod
    def registry_name() -> str:
        return "test-xor"

    @staticmethod
    def from_descriptor(version: str) -> Xor:
        return Xor()

    def get_descriptor(self) -> str:
        return "test-xor/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class W(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b) -> int:
                output.write(bytes(x ^ 0x5A for x in bytes(b)))
                return len(b)

            def close(self) -> None:
                output.close()
                super().close()

        return W()  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def test_enable_routes_checkpoint_id_calls_through_the_cache(dcp_enabled, tmp_path):
    """`dcp.save(sd, checkpoint_id=dir)` with no writer argument goes to the cache."""
    ck = tmp_path / "ck"
    sd = state(1)
    dcp.save(sd, checkpoint_id=ck)
    # Memory-only daemon: the item file is a cached object, and (commit_waits="files", the
    # default) also written next to the commit marker by the adapter.
    assert sorted(p.name for p in ck.iterdir()) == [".metadata", "__0_0.distcp"]
    assert [o.path for o in dcp_enabled.list(str(ck))] == [str(ck / "__0_0.distcp")]
    back = empty_like(sd)
    dcp.load(back, checkpoint_id=ck)
    assert_same(back, sd)

    cdcp.disable()
    plain = tmp_path / "plain"
    dcp.save(sd, checkpoint_id=plain)  # DCP's own FileSystemWriter again
    assert (plain / "__0_0.distcp").is_file() and not dcp_enabled.list(str(plain))
    assert not cdcp.is_enabled()


def test_writer_and_reader_take_every_stock_argument(client, tmp_path):
    """Every parameter of the installed FileSystemWriter/Reader is accepted and honoured."""
    writer_params = inspect.signature(dcp.FileSystemWriter.__init__).parameters
    reader_params = inspect.signature(dcp.FileSystemReader.__init__).parameters
    assert set(writer_params) - {"self"} <= set(inspect.signature(cdcp.CacheWriter).parameters) | {
        "single_file_per_rank", "sync_files", "thread_count", "per_thread_copy_ahead",
        "cache_staged_state_dict", "overwrite", "_extensions", "serialization_format",
    }  # fmt: skip
    sd = state(2)
    ck = tmp_path / "ck"
    w = cdcp.CacheWriter(
        ck, True, False, 2, 1_000, False, overwrite=False, _extensions=[Xor()],
        serialization_format=dcp.filesystem.SerializationFormat.TORCH_SAVE,
    )  # fmt: skip
    dcp.save(sd, storage_writer=w)
    # thread_count=2: two files per rank, as FileSystemWriter splits them.
    assert sorted(o.path.rsplit("/", 1)[1] for o in client.list(str(ck))) == [
        "__0_0.distcp",
        "__0_1.distcp",
    ]
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):  # as DCP's
        dcp.save(sd, storage_writer=cdcp.CacheWriter(ck, overwrite=False))
    registry = ExtensionRegistry()
    registry.register(Xor)
    back = empty_like(sd)
    dcp.load(back, storage_reader=cdcp.CacheReader(ck, registry))
    assert_same(back, sd)
    assert {"path", "_extension_registry"} <= set(reader_params)

    per_item = tmp_path / "per-item"
    dcp.save(sd, storage_writer=cdcp.CacheWriter(per_item, single_file_per_rank=False))
    assert len(client.list(str(per_item))) == len(sd["model"]) + 3  # one per item, as DCP
    with pytest.raises(ValueError, match=r"torch\.save archives"):
        cdcp.CacheWriter(ck, serialization_format=dcp.filesystem.SerializationFormat.SAFETENSORS)
    with pytest.raises(ValueError, match="commit_waits"):
        cdcp.CacheWriter(ck, commit_waits="later")


@pytest.fixture
def daemon(daemon_factory):
    """A daemon without spare segments, so that what a save reserves is all that shows."""
    return daemon_factory("--memory-limit", "1GiB", "--pool-bytes", "0")


def test_many_small_tensors_take_one_segment_per_rank(client, daemon, tmp_path):
    """300 tiny tensors: one cached object (one segment) per rank file, not one per tensor."""
    sd = {f"p{i}": torch.full((16,), float(i)) for i in range(300)}
    ck = tmp_path / "ck"
    dcp.save(sd, storage_writer=cdcp.CacheWriter(ck))
    st = daemon.status()
    data = sum(t.numel() * t.element_size() for t in sd.values())
    assert st.objects == 1 and st.segments == 1, st
    assert st.memory_used <= 2 * MiB, st  # reserved: one small segment, not 300 MiB
    assert data < st.memory_stored <= st.memory_used, st  # stored: the packed archives
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=cdcp.CacheReader(ck))
    assert_same(back, sd)


@pytest.mark.parametrize("persist", [False, True], ids=["memory-only", "persist-root"])
def test_dcp_own_reader_works_right_after_save(request, tmp_path, persist):
    """commit_waits="files": when dcp.save returns, DCP's FileSystemReader (no cache) and
    torch.load of the rank file work, with a daemon with or without a persist root."""
    c = request.getfixturevalue("persisting_client" if persist else "client")
    sd = state(3)
    ck = tmp_path / "ck"
    dcp.save(sd, storage_writer=cdcp.CacheWriter(ck, commit_waits="files"))
    assert sorted(p.name for p in ck.iterdir()) == [".metadata", "__0_0.distcp"]
    back = empty_like(sd)
    dcp.load(back, storage_reader=dcp.FileSystemReader(ck))
    assert_same(back, sd)
    packed = torch.load(ck / "__0_0.distcp")  # the persisted object is a torch.save archive
    assert packed.dtype == torch.uint8 and packed.numel() > 0
    info = c.status(ck / "__0_0.distcp")
    size = (ck / "__0_0.distcp").stat().st_size
    # Persisted by the daemon or written by the adapter (memory only), the file is the cached
    # archive plus its digest record (a member torch ignores), CRC-32s filled in.
    assert size > info.size
    with zipfile.ZipFile(ck / "__0_0.distcp") as z:
        assert z.testzip() is None
    shutil.rmtree(ck)


def test_persisted_rank_file_matches_what_the_writer_recorded(persisting_client, tmp_path):
    """Default commit_waits: once persisted, the directory is a plain DCP checkpoint whose
    offsets point at each item's own torch.save archive."""
    sd = state(4)
    ck = tmp_path / "ck"
    dcp.save(sd, storage_writer=cdcp.CacheWriter(ck))
    persisting_client.wait(prefix=str(ck), timeout=120)
    meta = dcp.FileSystemReader(ck).read_metadata()
    raw = (ck / "__0_0.distcp").read_bytes()
    for index, info in meta.storage_data.items():
        if index.fqn.startswith("model."):
            item = torch.load(io.BytesIO(raw[info.offset : info.offset + info.length]))
            assert torch.equal(item, sd["model"][index.fqn.removeprefix("model.")])
    persisting_client.delete(ck / "__0_0.distcp")  # cache off: only the files remain
    back = empty_like(sd)
    dcp.load(back, checkpoint_id=ck)
    assert_same(back, sd)


def test_packed_items_are_torch_save_archives_at_the_recorded_offsets():
    """The offsets the writer records are where torch.save (the write-through fallback) and
    the daemon's persisted archive put the blob's bytes; each span loads on its own."""
    from ckptcache.codec import packing
    from ckptcache.format.archive import parse_archive

    items = [torch.randn(3, 5), torch.arange(7), b"raw bytes item", torch.zeros(0)]
    blob, spans = packing.pack(items)
    buf = io.BytesIO()
    torch.save(blob, buf)
    (offset, size) = parse_archive(buf.getbuffer()).storages["0"]
    assert (offset, size) == (packing.storage_offsets(blob)[0], blob.numel())
    raw = buf.getvalue()
    for item, span in zip(items, spans, strict=True):
        chunk = raw[offset + span.offset : offset + span.offset + span.length]
        if isinstance(item, bytes):
            assert chunk == item
        else:
            assert_same(torch.load(io.BytesIO(chunk)), item)


def test_save_packed_writes_the_blob_straight_into_the_cache_and_through_to_a_file(
    daemon_factory, tmp_path
):
    """``Client.save_packed`` stores exactly the blob ``pack`` makes (as a cached ``uint8``
    tensor, and persisted at the returned offset); without a daemon it writes that same file
    with torch.save."""
    from ckptcache.codec import packing

    items = [torch.randn(64, 33), b"some bytes", torch.arange(10)[2:5], torch.zeros(0)]
    blob, spans = packing.pack(items)
    d = daemon_factory("--persist-root", str(tmp_path))
    with d.client() as c:
        packed = packing.Packed(items)
        assert packed.spans == spans and packed.nbytes == blob.numel()
        base = c.save_packed(packed, tmp_path / "rank0.distcp")
        assert torch.equal(c.load(tmp_path / "rank0.distcp", verify=True), blob)
        c.wait(tmp_path / "rank0.distcp", timeout=60)
    raw = (tmp_path / "rank0.distcp").read_bytes()
    assert raw[base : base + blob.numel()] == blob.numpy().tobytes()
    assert torch.equal(torch.load(tmp_path / "rank0.distcp"), blob)
    gone = ckptcache.Client(str(tmp_path / "no-daemon.sock"))
    with pytest.warns(ckptcache.CkptCacheWarning):
        assert gone.save_packed(packing.Packed(items), tmp_path / "through.distcp") == base
    assert torch.equal(torch.load(tmp_path / "through.distcp"), blob)
    with pytest.raises(ValueError, match="uint8 tensor of"):
        packing.Packed(items).fill(torch.empty(3, dtype=torch.uint8))


def test_write_through_without_a_daemon_is_a_plain_dcp_checkpoint(tmp_path, monkeypatch):
    """No daemon: the rank file is written with torch.save and DCP's own reader loads it."""
    monkeypatch.setenv("CKPTCACHE_SOCKET", "/nonexistent/ckptcache.sock")
    ckptcache.api.set_default_client(None)
    sd = state(5)
    ck = tmp_path / "ck"
    with pytest.warns(ckptcache.CkptCacheWarning):
        dcp.save(sd, storage_writer=cdcp.CacheWriter(ck))
    back = empty_like(sd)
    dcp.load(back, storage_reader=dcp.FileSystemReader(ck))
    assert_same(back, sd)
    ckptcache.api.set_default_client(None)
    shutil.rmtree(ck)


@pytest.mark.parametrize("persist", [False, True], ids=["memory-only", "persist-root"])
def test_files_saved_twice_into_one_directory_hold_the_second_save(request, tmp_path, persist):
    """commit_waits="files", the same directory saved twice: when the second dcp.save returns,
    the rank file holds the second save (DCP's new ``.metadata`` points into it), not the first
    one's file left in place."""
    request.getfixturevalue("persisting_client" if persist else "client")
    ck = tmp_path / "ck"
    for w in (1.0, 2.0):
        dcp.save(
            {"w": torch.full((4, 4), w)}, storage_writer=cdcp.CacheWriter(ck, commit_waits="files")
        )
        back = {"w": torch.zeros(4, 4)}
        dcp.load(back, storage_reader=dcp.FileSystemReader(ck))
        assert torch.equal(back["w"], torch.full((4, 4), w))
    shutil.rmtree(ck)


def converted(ck, out) -> dict:
    """What DCP's own ``format_utils.dcp_to_torch_save`` makes of the checkpoint in ``ck``
    (it reads with the ``FileSystemReader`` it builds itself)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ck, out)
    return torch.load(out, weights_only=False)


def reference(sd: dict, tmp_path) -> dict:
    """``converted`` of the same state saved by DCP's own ``FileSystemWriter``."""
    ref = tmp_path / "reference"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ref))
    return converted(ref, tmp_path / "reference.pt")


def test_default_commit_waits_lets_dcp_tools_read_right_after_save(client, tmp_path):
    """No ``commit_waits`` given, a memory-only daemon: DCP's ``format_utils`` converter (the
    stock reader, which no ``enable()`` reaches) reads the directory right after ``dcp.save``,
    and right after ``dcp.async_save``'s future, as with DCP's own writer."""
    sd = state(7)
    expected = reference(sd, tmp_path)
    ck = tmp_path / "ck"
    dcp.save(sd, storage_writer=cdcp.CacheWriter(ck))
    assert_same(converted(ck, tmp_path / "out.pt"), expected)
    assert [o.path for o in client.list(str(ck))] == [str(ck / "__0_0.distcp")]  # cached too

    later = tmp_path / "async"
    dcp.async_save(sd, storage_writer=cdcp.CacheWriter(later)).result()
    assert_same(converted(later, tmp_path / "async.pt"), expected)
    shutil.rmtree(ck)


def test_enable_also_covers_format_utils(client, tmp_path):
    """After ``enable()``, DCP's converters build the cache's reader: with
    ``commit_waits="local"`` the rank file is only in memory and ``dcp_to_torch_save`` still
    converts the checkpoint; ``disable()`` gives ``format_utils`` its stock classes back."""
    from torch.distributed.checkpoint import format_utils

    sd = state(8)
    expected = reference(sd, tmp_path)
    cdcp.enable(commit_waits="local")
    try:
        ck = tmp_path / "ck"
        dcp.save(sd, checkpoint_id=ck)
        assert sorted(p.name for p in ck.iterdir()) == [".metadata"]  # the items: in memory
        assert_same(converted(ck, tmp_path / "out.pt"), expected)
    finally:
        cdcp.disable()
    assert format_utils.FileSystemReader is dcp.FileSystemReader
    assert format_utils.FileSystemWriter is dcp.FileSystemWriter
