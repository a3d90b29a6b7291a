"""Corrupt and truncated segments: detected, named, dropped; nothing else lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptcache
from ckptcache.errors import CorruptCheckpoint
from tests.helpers import read_only_dir, wait_until


def wait_digested(client, path, timeout=30.0):
    wait_until(lambda: client.status(path).digests_valid, timeout, "the digests to be recorded")


def flip_bytes_of(daemon, client, path, tensor_index=1):
    """Overwrite a few bytes of one tensor inside the daemon's segment file."""
    st = client.status(path)
    from ckptcache.format.layout import SegmentHeader
    from ckptcache.format.manifest import Manifest

    seg = os.path.join(daemon.segments_dir, st.segment)
    with open(seg, "r+b") as f:
        header = SegmentHeader.unpack(f.read(4096))
        f.seek(header.manifest_offset)
        manifest = Manifest.from_json(f.read(header.manifest_size))
        record = manifest.storages[tensor_index]
        f.seek(record.offset + 8)
        f.write(b"\xde\xad\xbe\xef")
    return record.name


def test_corrupt_tensor_is_named_and_dropped(daemon, tmp_path):
    path = str(tmp_path / "m.pt")
    with daemon.client() as c:
        c.save({"model": {"embed": torch.zeros(1000), "head": torch.ones(1000)}}, path)
        wait_digested(c, path)
        bad = flip_bytes_of(daemon, c, path)
        assert bad == "model.head"
        report = c.verify(path)
        assert not report.ok and "model.head" in report.error
        with pytest.raises(CorruptCheckpoint, match=r"model\.head") as err:
            c.load(path, verify=True)
        assert err.value.tensor == "model.head" and err.value.tier == "local"
        assert not c.exists(path)  # the bad copy was dropped


@pytest.mark.parametrize("digested", [False, True])
def test_a_segment_file_cut_behind_the_daemon_is_refused_not_read(daemon, tmp_path, digested):
    """A read of a mapping past its file's end is a SIGBUS: the daemon (hashing it) or the
    trainer (reading its zero-copy tensors) would die, and with the daemon every checkpoint
    it holds. The cut file is refused as corrupt; the daemon and its other checkpoints
    live on."""
    path, other = str(tmp_path / "cut.pt"), str(tmp_path / "other.pt")
    with daemon.client() as c:
        c.save({"w": torch.arange(4096.0)}, path)
        c.save({"o": torch.ones(4)}, other)
        if digested:
            wait_digested(c, path)
        os.truncate(os.path.join(daemon.segments_dir, c.status(path).segment), 4096)
        with pytest.raises(CorruptCheckpoint, match="was cut"):
            c.load(path, verify=True)
        assert daemon.proc.poll() is None
        assert torch.equal(c.load(other)["o"], torch.ones(4))


def test_corrupt_copy_falls_back_to_the_file(daemon_factory, tmp_path):
    """The corrupt generation was persisted: the file holds the same save, and is loaded."""
    path = tmp_path / "m.pt"
    good = {"w": torch.arange(1000.0), "v": torch.ones(10)}
    d = daemon_factory("--persist-root", str(tmp_path))
    with d.client() as c:
        c.save(good, path)
        c.wait(path, timeout=60)
        wait_digested(c, str(path))
        flip_bytes_of(d, c, str(path), 0)
        out = c.load(path, verify=True)
        assert torch.equal(out["w"], good["w"])


def test_corrupt_copy_never_falls_back_to_an_older_file(daemon_factory, tmp_path):
    """step1 persisted, step2 cached but not persisted yet (its directory refuses files), then
    step2's segment corrupt: load(verify=True) raises instead of returning step1's file."""
    ck = tmp_path / "ck"
    ck.mkdir()
    path = ck / "m.pt"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("persist_retries: 100000\npersist_backoff: 0.05\npersist_backoff_max: 0.2\n")
    d = daemon_factory("--persist-root", str(tmp_path), "--config", str(cfg))
    with d.client() as c:
        c.save({"step": torch.tensor(1), "w": torch.zeros(1000)}, path)
        c.wait(path, timeout=60)
        with read_only_dir(ck):
            c.save({"step": torch.tensor(2), "w": torch.ones(1000)}, path)
            wait_digested(c, str(path))
            assert "persisted" not in c.status(path).stages
            flip_bytes_of(d, c, str(path), 1)
            with pytest.raises(CorruptCheckpoint, match="older than this generation") as err:
                c.load(path, verify=True)
        assert err.value.tensor == "w" and err.value.tier == "local"
        assert int(torch.load(path)["step"]) == 1  # the file is step1's, left as it was


def test_corrupt_copy_falls_back_to_a_file_written_after_it(daemon, tmp_path):
    """Memory-only: a file written after the save (stamped later than its commit) is newer,
    so it is what the load returns."""
    path = tmp_path / "m.pt"
    with daemon.client() as c:
        c.save({"step": torch.tensor(1), "w": torch.zeros(1000)}, path)
        wait_digested(c, str(path))
        committed_ns = round(c.status(path).committed * 1e9)
        torch.save({"step": torch.tensor(2), "w": torch.ones(1000)}, path)
        os.utime(path, ns=(committed_ns + 1_000_000, committed_ns + 1_000_000))
        flip_bytes_of(daemon, c, str(path), 1)
        assert int(c.load(path, verify=True)["step"]) == 2


def test_inspect_verify_reports_corruption(daemon, tmp_path):
    path = str(tmp_path / "m.pt")
    with daemon.client() as c:
        c.save({"a": torch.zeros(100), "b": torch.zeros(100)}, path)
        wait_digested(c, path)
        flip_bytes_of(daemon, c, path, 0)
    env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
    out = subprocess.run([sys.executable, "-m", "ckptcache.cli", "inspect", path, "--verify",
                          "--json"], env=env, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 1
    report = json.loads(out.stdout)["verify"]
    assert report["ok"] is False and "'a'" in report["error"]


def test_garbage_and_truncated_segments_are_dropped_at_restart(daemon, tmp_path):
    path = str(tmp_path / "ok.pt")
    with daemon.client() as c:
        c.save({"w": torch.ones(10)}, path)
    garbage = os.path.join(daemon.segments_dir, "seg-garbage-000001")
    with open(garbage, "wb") as f:
        f.write(os.urandom(8192))
    truncated = os.path.join(daemon.segments_dir, "seg-short-000001")
    with open(truncated, "wb") as f:
        f.write(b"CKPTSEG\x00")
    daemon.restart()
    assert not os.path.exists(garbage) and not os.path.exists(truncated)
    with daemon.client() as c:
        assert torch.equal(c.load(path, verify=True)["w"], torch.ones(10))
    log = daemon.log()
    assert "unreadable header" in log and "truncated" in log


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_a_persisted_file_cut_to_a_few_bytes_is_corrupt(daemon_factory, tmp_path, keep):
    """Cut inside the zip's first four bytes, it was taken for a legacy pickle and torch's
    ``UnpicklingError`` came out; with a daemon (the copy in memory gone) and without."""
    root = tmp_path / "ckpt"
    root.mkdir()
    d = daemon_factory("--persist-root", str(root))
    path = str(root / "m.pt")
    with d.client() as c:
        c.save({"w": torch.ones(100)}, path, durability="persisted")
        c.delete(path)
        with open(path, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(CorruptCheckpoint, match="too short to be a zip archive"):
            c.load(path)
    with pytest.raises(CorruptCheckpoint, match="too short to be a zip archive"):
        ckptcache.Client(str(tmp_path / "none.sock")).load(path)  # no daemon: storage
