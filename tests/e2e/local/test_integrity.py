"""End-to-end integrity on one node: persist verifies, persisted files carry checksums, and
damage to a stored file is a typed, named error."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from ckptcache.errors import CheckpointNotFound, CorruptCheckpoint, PersistError
from ckptcache.format.persisted import DIGESTS_MEMBER
from ckptcache.storage.fs import TEMP_MARK
from tests.e2e.local.test_corrupt import flip_bytes_of, wait_digested
from tests.e2e.local.test_persist import config
from tests.helpers import assert_same, read_only_dir, wait_until


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"embed": torch.randn(256, 64, generator=g), "head": torch.randn(4096, generator=g)},
            "step": seed}  # fmt: skip


def persisted(daemon_factory, tmp_path, obj):
    """A daemon with a persist root and ``obj`` persisted at ``<root>/m.pt``."""
    root = tmp_path / "ckpt"
    d = daemon_factory("--persist-root", str(root), "--config", config(tmp_path))
    path = root / "m.pt"
    with d.client() as c:
        c.save(obj, path, durability="persisted")
    return d, path


def test_persist_refuses_bytes_changed_in_memory(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    target_dir = root / "iter_1"
    target_dir.mkdir(parents=True)
    cfg = config(tmp_path, persist_retries=1000, persist_backoff=0.2, persist_backoff_max=0.2)
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    path = target_dir / "m.pt"
    with d.client() as c:
        with read_only_dir(target_dir):  # hold the persist back while the bytes go bad
            c.save(state(1), path)
            wait_digested(c, path)
            assert flip_bytes_of(d, c, path) == "model.head"
            wait_until(lambda: c.status(path).persist_error != "")
        with pytest.raises(PersistError, match=r"corrupt.*model\.head"):
            c.wait(path, timeout=60)
        st = c.status(path)
        assert st.persist_state == "failed" and "persisted" not in st.stages
        with pytest.raises(CorruptCheckpoint, match=r"model\.head"):
            c.load(path)  # known-bad bytes are never served, not even without verify
    assert not path.exists()
    assert [p for p in root.rglob("*") if TEMP_MARK in p.name] == []
    assert "not persisting" in d.log()


def test_persisted_file_has_real_crcs_and_a_digest_record(daemon_factory, tmp_path):
    d, path = persisted(daemon_factory, tmp_path, state(2))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        names = z.namelist()
        assert all(z.getinfo(n).CRC != 0 for n in names if z.getinfo(n).file_size)
        assert f"archive/{DIGESTS_MEMBER}" in names
    assert_same(state(2), torch.load(path, weights_only=True))
    assert_same(state(2), torch.load(path, weights_only=True, mmap=True))
    with d.client() as c:
        c.delete(path)
        assert_same(state(2), c.load(path, verify=True))  # from storage, verified


def test_flipped_byte_in_persisted_file_is_caught_with_verify(daemon_factory, tmp_path):
    d, path = persisted(daemon_factory, tmp_path, state(3))
    data = bytearray(path.read_bytes())
    offset = data.index(torch.load(path)["model"]["head"][:4].numpy().tobytes())
    data[offset + 1] ^= 0x40
    path.write_bytes(bytes(data))
    with d.client() as c:
        c.delete(path)
        with pytest.raises(CorruptCheckpoint, match=r"m\.pt.*data/\d") as err:
            c.load(path, verify=True)
        assert err.value.tier == "storage"
    out = subprocess.run(
        [sys.executable, "-m", "ckptcache.cli", "inspect", "--verify", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode != 0 and "does not match its digest" in out.stdout + out.stderr


def test_truncated_or_empty_file_is_corrupt_not_a_torch_error(daemon_factory, tmp_path):
    d, path = persisted(daemon_factory, tmp_path, state(4))
    data = path.read_bytes()
    with d.client() as c:
        c.delete(path)
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(CorruptCheckpoint, match=r"m\.pt.*truncated"):
            c.load(path)  # even without verify
        assert not c.exists(path)
        path.write_bytes(b"")
        with pytest.raises(CorruptCheckpoint, match=r"m\.pt.*empty"):
            c.load(path)
        assert not c.exists(path)
        with pytest.raises(CheckpointNotFound):
            c.status(path)


def edit_segment(daemon, client, path, old: bytes, new: bytes) -> None:
    """Replace the first ``old`` by ``new`` (same length) in the daemon's segment of ``path``
    (the archive, skeleton first, comes before the manifest)."""
    seg = os.path.join(daemon.segments_dir, client.status(path).segment)
    with open(seg, "r+b") as f:
        data = f.read()
        f.seek(data.index(old))
        f.write(new)


def test_edited_skeleton_is_caught(daemon, tmp_path):
    path = tmp_path / "m.pt"
    with daemon.client() as c:
        c.save({"w0": torch.ones(100), "step": 7}, path)
        wait_digested(c, path)
        edit_segment(daemon, c, path, b"w0", b"x0")  # the key lives in the pickle skeleton
        report = c.verify(path)
        assert not report.ok and "skeleton" in report.error
        with pytest.raises(CorruptCheckpoint, match="skeleton"):
            c.load(path, verify=True)


@pytest.mark.parametrize("version", [1, 99])
def test_segment_of_an_unknown_layout_version_is_reclaimed(daemon, tmp_path, version):
    """A segment of another layout (an unreleased earlier one, a newer one) is reclaimed at
    start with a log line naming its version."""
    path = tmp_path / "m.pt"
    with daemon.client() as c:
        c.save({"w": torch.ones(100)}, path)
        seg = os.path.join(daemon.segments_dir, c.status(path).segment)
    daemon.kill()
    with open(seg, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", version))
    daemon.restart()
    with daemon.client() as c:
        assert not c.exists(path)
        c.save({"w": torch.zeros(10)}, path)  # the daemon works on
        assert_same({"w": torch.zeros(10)}, c.load(path))
    assert f"unknown segment layout version {version} " in daemon.log()
