"""The batch file format: the segment layout of checkpoints, published atomically."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ckptcache.data._batchfile import check_batch, prepare_batch, read_batch, write_batch
from ckptcache.data._crypto import ENV_KEY, BatchCipher
from ckptcache.errors import ConfigError, CorruptCheckpoint, UnsafeUnpickle
from ckptcache.format.layout import HEADER_SIZE, DigestState, SegmentHeader, SegmentState


def _write(directory: str, obj: object, key: str = "run/train/b0", cipher=None) -> str:
    write_batch(directory, "b0.batch", prepare_batch(key, obj), cipher)
    return os.path.join(directory, "b0.batch")


@pytest.mark.parametrize(
    "batch",
    [
        torch.arange(10),
        {"x": torch.randn(3, 4), "y": [torch.ones(2, dtype=torch.bfloat16), 7, "s"]},
        [torch.randn(5)[::2], {"nested": (1, 2.5, None)}],
        {"plain": [1, 2, 3], "text": "no tensors at all"},
    ],
)
def test_round_trip(cache_dir: str, batch: object) -> None:
    os.makedirs(cache_dir)
    path = _write(cache_dir, batch)
    got = read_batch(path, "run/train/b0", None)
    assert repr(got) == repr(batch)


def test_file_is_a_committed_segment_with_valid_digests(cache_dir: str) -> None:
    os.makedirs(cache_dir)
    path = _write(cache_dir, {"x": torch.randn(100)})
    with open(path, "rb") as f:
        header = SegmentHeader.unpack(f.read(HEADER_SIZE))
    assert header.state == SegmentState.COMMITTED
    assert header.digest_state == DigestState.VALID
    assert os.listdir(cache_dir) == ["b0.batch"]  # no temp file left behind
    assert check_batch(path, "run/train/b0", encrypted=False)
    assert not check_batch(path, "run/train/b1", encrypted=False)


def test_reads_are_copy_on_write(cache_dir: str) -> None:
    os.makedirs(cache_dir)
    path = _write(cache_dir, {"x": torch.zeros(1000)})
    first = read_batch(path, "run/train/b0", None)
    first["x"].add_(1)  # a trainer modifying its batch in place
    again = read_batch(path, "run/train/b0", None)  # digests verified: file unchanged
    assert torch.equal(again["x"], torch.zeros(1000))


def test_corrupt_or_foreign_files_are_refused(cache_dir: str) -> None:
    os.makedirs(cache_dir)
    path = _write(cache_dir, {"x": torch.zeros(1000)})
    with pytest.raises(CorruptCheckpoint, match="not 'other/train/b0'"):
        read_batch(path, "other/train/b0", None)  # a file of another run, renamed
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 2048)
        f.write(b"\x01\x02")  # flip tensor bytes
    with pytest.raises(CorruptCheckpoint):
        read_batch(path, "run/train/b0", None)


def test_weights_only_refuses_arbitrary_classes(cache_dir: str) -> None:
    os.makedirs(cache_dir)
    path = _write(cache_dir, {"f": shutil.copy})
    with pytest.raises(UnsafeUnpickle):
        read_batch(path, "run/train/b0", None)
    assert read_batch(path, "run/train/b0", None, weights_only=False)["f"] is shutil.copy


def test_encrypted_batches(cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cryptography")
    os.makedirs(cache_dir)
    monkeypatch.setenv(ENV_KEY, "a" * 64)
    cipher = BatchCipher.from_env()
    secret = torch.arange(4096, dtype=torch.int32)
    path = _write(cache_dir, {"x": secret}, cipher=cipher)
    with open(path, "rb") as f:
        stored = f.read()
    assert secret.numpy().tobytes()[:64] not in stored  # only ciphertext at rest
    assert torch.equal(read_batch(path, "run/train/b0", cipher)["x"], secret)
    with pytest.raises(CorruptCheckpoint, match="authentication"):
        read_batch(path, "run/train/b1", cipher)  # moved to another step
    with pytest.raises(ConfigError, match="encrypted"):
        read_batch(path, "run/train/b0", None)
    plain = _write(cache_dir, {"x": secret})
    with pytest.raises(ConfigError, match="not encrypted"):
        read_batch(plain, "run/train/b0", cipher)
    monkeypatch.setenv(ENV_KEY, "short")
    with pytest.raises(ConfigError):
        BatchCipher.from_env()


@pytest.mark.parametrize("encrypted", [False, True])
def test_a_batch_file_that_is_not_ours_alone_is_never_unpickled(
    cache_dir: str, encrypted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.makedirs(cache_dir)
    cipher = None
    if encrypted:
        pytest.importorskip("cryptography")
        monkeypatch.setenv(ENV_KEY, "11" * 32)
        cipher = BatchCipher.from_env()
    path = _write(cache_dir, {"x": torch.arange(4)}, cipher=cipher)
    link = os.path.join(cache_dir, "link.batch")
    os.symlink(path, link)  # a link is refused even to a good batch: names are not trusted
    with pytest.raises(ConfigError, match="is a symbolic link: refusing to serve it"):
        read_batch(link, "run/train/b0", cipher)
    os.chmod(path, 0o622)  # others may write it: it could be swapped under us
    with pytest.raises(ConfigError, match=r"\(mode 0622\).*refusing to serve it"):
        read_batch(path, "run/train/b0", cipher)
    os.chmod(path, 0o600)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(path, 65534, 65534)
        with pytest.raises(ConfigError, match="belongs to uid 65534"):
            read_batch(path, "run/train/b0", cipher)
