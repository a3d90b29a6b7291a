"""Every byte of a persisted archive is covered by a check: flip any one of them and each
reader of stored files raises :class:`CorruptCheckpoint` (tier ``storage``), nothing else.

The persisted form (:func:`stream_archive`) of a small ``torch.save`` archive, every byte
flipped in turn (two bit positions), read by the checker (:func:`check_archive`), by the
reader that checks as it reads (:func:`read_archive`, several threads, ranges cutting
records), and by the client's load of a stored file (:func:`load_from_storage`, default
arguments). Also: tensors of a damaged storage are named by their state-dict path, read from
the skeleton without torch (:func:`storage_names`).
"""

from __future__ import annotations

import argparse
import io

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.stored_load import load_from_storage
from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.archive_read import read_archive
from ckptcache.format.names import storage_names
from ckptcache.format.persisted import check_archive, stream_archive
from tests.helpers import assert_same

MASKS = (0x01, 0x80)


def small_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(40, generator=g), "b": {"c": torch.arange(5)}, "s": 3}


def persisted_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    out = bytearray()
    stream_archive(memoryview(buf.getvalue()), out.extend, path="mem")
    return bytes(out)


def flips(data: bytes, step: int = 1, masks: tuple[int, ...] = MASKS):
    for offset in range(0, len(data), step):
        for mask in masks:
            damaged = bytearray(data)
            damaged[offset] ^= mask
            yield offset, mask, bytes(damaged)


class MemoryBackend:
    """Just what :func:`read_archive` asks of a backend: ranged reads of one object."""

    def __init__(self, data: bytes):
        self.data = data

    def read_into(self, path: str, offset: int, view: memoryview) -> None:
        chunk = self.data[offset : offset + len(view)]
        if len(chunk) < len(view):
            raise OSError(f"{path} ended early")
        view[:] = chunk


def refused(read, what: str, **sample) -> list[str]:
    """Run ``read()`` for every flip (or the ``sample`` of :func:`flips`); the flips it did
    not refuse with CorruptCheckpoint."""
    data = persisted_bytes(small_state())
    read(data)  # the intact archive passes
    missed = []
    for offset, mask, damaged in flips(data, **sample):
        try:
            read(damaged)
        except CorruptCheckpoint as e:
            if e.tier != "storage":
                missed.append(f"{what} @{offset}^{mask:#x}: tier {e.tier!r}")
        except Exception as e:  # listed as a miss
            missed.append(f"{what} @{offset}^{mask:#x}: {type(e).__name__}: {e}")
        else:
            missed.append(f"{what} @{offset}^{mask:#x}: accepted")
    return missed


def test_the_checker_refuses_every_flipped_byte():
    assert refused(lambda d: check_archive(memoryview(d), "p", deep=True), "check") == []


def test_the_reader_that_checks_as_it_reads_refuses_every_flipped_byte():
    def read(data: bytes) -> None:
        read_archive(MemoryBackend(data), "p", memoryview(bytearray(len(data))),  # type: ignore[arg-type]
                     concurrency=3, advance=lambda n: None, chunk=1 << 20)  # fmt: skip

    assert refused(read, "read", masks=(0x01,)) == []


def test_a_load_of_a_stored_file_refuses_flipped_bytes(tmp_path):
    """Every third byte (the readers above cover every byte; this is their wiring)."""
    path = tmp_path / "m.pt"

    def load(data: bytes) -> None:
        path.write_bytes(data)
        assert_same(small_state(), load_from_storage(str(path)))

    assert refused(load, "load", step=3, masks=(0x01,)) == []


@pytest.mark.parametrize("mmap", [None, True])
def test_load_from_storage_builds_the_object_over_the_checked_bytes(tmp_path, mmap):
    path = tmp_path / "m.pt"
    obj = {"w": torch.randn(64, 8), "v": torch.arange(7).view(7, 1).t(), "n": "x"}
    torch.save(obj, path)  # plain torch.save: checked against its CRC-32s
    out = load_from_storage(str(path), mmap=mmap)
    assert_same(obj, out)
    out["w"].add_(1)  # private memory: the file is never written through a loaded tensor
    assert_same(obj, torch.load(path, weights_only=True))


def test_tensor_names_come_from_the_skeleton_as_a_save_records_them():
    shared = torch.randn(10)
    obj = {
        "model": {"embed": torch.randn(5, 3), "head": torch.nn.Parameter(torch.ones(2))},
        "args": argparse.Namespace(lr=0.1, mask=torch.ones(2, dtype=torch.bool)),
        "opt": [shared, shared[2:], {"exp_avg": torch.zeros(3, dtype=torch.bfloat16)}],
        "step": 3,
    }
    flat = flatten(obj)
    assert storage_names(flat.skeleton) == {i.key: i.name for i in flat.infos}
    assert storage_names(flatten(torch.ones(2)).skeleton) == {"0": "<root>"}
    assert storage_names(b"not a pickle") == {}
