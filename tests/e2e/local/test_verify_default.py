"""Bytes that cross a tier are verified by default (one daemon, real persisted files).

A persisted archive gets one flipped byte in each of its regions (a local header, a tensor's
data, the pickle skeleton, the central directory, the digest record, the end records); every
way of loading it with default arguments from storage (the client's own read of the file with
no cached copy, ``prefetch``, ``ckptcache.open``, and a client without a daemon) raises
:class:`CorruptCheckpoint` naming the storage tier and, for tensor data, the tensor. Never an
``IndexError``, never NaN or a changed value.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptcache
from ckptcache.errors import CorruptCheckpoint
from tests.e2e.local.test_persist import config
from tests.helpers import assert_same


def state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"model": {"embed": torch.randn(256, 64, generator=g),
                      "head": torch.randn(4096, generator=g)}, "step": 3}  # fmt: skip


def _local_data_offset(data: bytes, info: zipfile.ZipInfo) -> int:
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def regions(data: bytes) -> dict[str, tuple[int, str | None]]:
    """Where to flip a byte in each region of a persisted archive, and the tensor whose name
    the error must carry (None: not a tensor's bytes)."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = {i.filename: i for i in z.infolist()}
    (cd,) = struct.unpack_from("<I", data, len(data) - 22 + 16)
    if cd == 0xFFFFFFFF:  # zip64: the locator points at the zip64 end record
        (eocd64,) = struct.unpack_from("<Q", data, len(data) - 42 + 8)
        (cd,) = struct.unpack_from("<Q", data, eocd64 + 48)
    pickle = _local_data_offset(data, infos["archive/data.pkl"])
    head = torch.load(io.BytesIO(data), weights_only=True)["model"]["head"]
    digests = _local_data_offset(data, infos["archive/.ckptcache/digests.json"])
    first_data = infos["archive/data/0"].header_offset
    return {
        "first byte": (0, None),
        "local header name": (first_data + 30 + len("archive/data/"), None),
        "tensor data": (data.index(head[:8].numpy().tobytes()) + 3, "model.head"),
        "pickle skeleton": (pickle + data[pickle:].index(b"head"), None),
        "central directory crc": (cd + 16, None),
        "central directory name": (cd + 46 + 3, None),
        "central directory version": (cd + 4, None),
        "digest record": (digests + len(b'{"algorithm":"xxh3_64","format":1,"records":{"'), None),
        "end record": (len(data) - 22 + 4, None),
    }


def flipped(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x04
    return bytes(out)


def assert_corrupt(load: Callable[[], object], tensor: str | None, where: str) -> None:
    """``load()`` raises CorruptCheckpoint naming the storage tier (and the tensor)."""
    try:
        got = load()
    except CorruptCheckpoint as e:
        assert e.tier == "storage", (where, e.tier, str(e))
        assert "storage" in str(e), (where, str(e))
        if tensor is not None:
            assert e.tensor == tensor and tensor in str(e), (where, e.tensor, str(e))
        return
    except Exception as e:  # the assertion names what was raised instead
        raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
    raise AssertionError(f"{where}: loaded without an error: {got!r:.200}")


@pytest.fixture
def persisted(daemon_factory, tmp_path):
    """A daemon with a persist root, ``state()`` persisted at ``<root>/m.pt`` and dropped from
    memory (only storage holds it); yields (daemon, path, the file's bytes)."""
    root = tmp_path / "ckpt"
    d = daemon_factory("--persist-root", str(root), "--config", config(tmp_path))
    path = root / "m.pt"
    with d.client() as c:
        c.save(state(), path, durability="persisted")
        c.delete(path)
    return d, path, path.read_bytes()


REGIONS = [
    "first byte", "local header name", "tensor data", "pickle skeleton",
    "central directory crc", "central directory name", "central directory version",
    "digest record", "end record",
]  # fmt: skip


@pytest.mark.parametrize("region", REGIONS)
def test_flipped_byte_anywhere_in_a_persisted_file_is_caught_by_default(
    persisted, tmp_path, monkeypatch, region
):
    d, path, good = persisted
    offset, tensor = regions(good)[region]
    path.write_bytes(flipped(good, offset))
    with d.client() as c:
        assert_corrupt(lambda: c.load(path), tensor, f"{region}: client read of the file")
        assert_corrupt(lambda: c.load(path, mmap=True), tensor, f"{region}: mmap read")
        assert_corrupt(lambda: c.prefetch(path), tensor, f"{region}: prefetch")
        assert_corrupt(lambda: ckptcache.open(path, client=c), tensor, f"{region}: open")
        assert not c.exists(path) or "local" not in c.status(path).stages  # nothing cached
    # No daemon at all: the client reads the file itself, verified all the same.
    monkeypatch.setenv("CKPTCACHE_SOCKET", str(tmp_path / "no-daemon.sock"))
    with ckptcache.Client(str(tmp_path / "no-daemon.sock")) as lone:
        with pytest.warns(ckptcache.CkptCacheWarning):
            lone.save({"x": torch.zeros(1)}, tmp_path / "ckpt" / "other.pt")  # daemon gone
        assert_corrupt(lambda: lone.load(path), tensor, f"{region}: no daemon")
    path.write_bytes(good)
    with d.client() as c:  # the good file loads again, verified
        assert_same(state(), c.load(path))
        with ckptcache.open(path, client=c) as f:
            assert_same(state(), torch.load(f, weights_only=True))


def test_verify_false_is_an_explicit_opt_out_for_storage(persisted):
    """``verify=False`` skips the digests (the structure is still checked): a flipped tensor
    byte then loads as a changed value, as the caller asked."""
    d, path, good = persisted
    offset, _ = regions(good)["tensor data"]
    path.write_bytes(flipped(good, offset))
    with d.client() as c:
        out = c.load(path, verify=False)
        assert not torch.equal(out["model"]["head"], state()["model"]["head"])
        with ckptcache.open(path, client=c, verify=False) as f:
            assert f.read() == path.read_bytes()


def test_plain_torch_save_file_is_checked_against_its_crcs(daemon, tmp_path):
    """A file written by plain ``torch.save`` (no digest record) is checked against its zip
    CRC-32s by default."""
    path = tmp_path / "plain.pt"
    torch.save(state(), path)
    good = path.read_bytes()
    head = state()["model"]["head"][:8].numpy().tobytes()
    path.write_bytes(flipped(good, good.index(head) + 5))
    with daemon.client() as c:
        with pytest.raises(CorruptCheckpoint, match=r"storage.*model\.head") as e:
            c.load(path)
        assert e.value.tier == "storage" and e.value.tensor == "model.head"
    path.write_bytes(good)
    with daemon.client() as c:
        assert_same(state(), c.load(path))
        assert_same(state(), c.load(path, mmap=True))


def test_prefetch_on_a_single_daemon_warms_from_storage(persisted):
    """No cluster: ``prefetch`` of a path only storage holds reads it into this node's memory
    (verified) and says it came from storage; the next load is served from memory."""
    d, path, _ = persisted
    with d.client() as c:
        assert c.prefetch(path) == ["storage"]
        info = c.status(path)
        assert "local" in info.stages and info.persist_state == "persisted"
        assert_same(state(), c.load(path))
        assert c.status(path).last_load_tier == "local"
        assert c.prefetch(path) == ["local"]  # already here


def test_prefetch_of_a_missing_path_is_not_found(daemon, tmp_path):
    with daemon.client() as c, pytest.raises(ckptcache.CheckpointNotFound):
        c.prefetch(tmp_path / "absent.pt")


def test_default_load_of_a_missing_file_is_not_found(daemon, tmp_path):
    with daemon.client() as c, pytest.raises(ckptcache.CheckpointNotFound):
        c.load(Path(tmp_path / "absent.pt"))
