"""A copy received from a peer: every tensor hashed record by record as the records are
authenticated, and checked against the sender's table before anything is used."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import Manifest, compute_digests, pack_digests
from ckptcache.server.cluster.dataplane import Channel
from ckptcache.server.cluster.transfer import receive_object


def _image() -> tuple[bytearray, Manifest, int]:
    # Tensors of odd sizes (one of them empty), so storages start and end inside records.
    obj = {"a": torch.arange(70_001, dtype=torch.float32), "empty": torch.ones(0),
           "b": torch.full((33_333,), 7, dtype=torch.int16), "c": torch.randn(50_000)}  # fmt: skip
    flat = flatten(obj)
    plan = plan_object(flat, "/ckpt/model.pt", "default")
    image = bytearray(plan.layout.nbytes)
    write_object(memoryview(image), plan, flat)  # type: ignore[arg-type]
    table = compute_digests(memoryview(image), plan.manifest)
    off = plan.layout.digest_offset
    image[off : off + 8 * len(table)] = pack_digests(table)
    return image, plan.manifest, off


def _transfer(image: bytearray, manifest: Manifest, digest_offset: int, record: int) -> tuple:
    """Send the body through a real channel in ``record``-byte records; receive it."""
    sa, sb = socket.socketpair()
    sender, receiver = Channel(sa, b"k" * 32, b"r" * 32), Channel(sb, b"r" * 32, b"k" * 32)
    body = bytes(image[HEADER_SIZE:digest_offset])
    table = bytes(image[digest_offset:])

    def send() -> None:
        for start in range(0, len(body), record):
            sender.send_bytes(body[start : start + record])
        sender.send_bytes(table)

    t = threading.Thread(target=send)
    t.start()
    view = memoryview(bytearray(len(image) - HEADER_SIZE))
    seen: list[int] = []
    try:
        got = receive_object(receiver, view, manifest, digest_offset, seen.append)
    finally:
        t.join()
        sender.close()
        receiver.close()
    return got, bytes(view), seen


@pytest.mark.parametrize("record", [4096, 65_537, 1 << 20])
def test_every_tensor_is_hashed_across_records(record):
    image, manifest, digest_offset = _image()
    got, landed, seen = _transfer(image, manifest, digest_offset, record)
    assert got == compute_digests(memoryview(image), manifest)
    assert landed == bytes(image[HEADER_SIZE:])
    assert seen == sorted(seen) and seen[-1] == len(image) - HEADER_SIZE


def test_a_tensor_that_differs_from_the_table_is_refused():
    image, manifest, digest_offset = _image()
    record = manifest.storages[-1]
    image[record.offset + record.nbytes // 2] ^= 0xFF  # after the table was computed
    with pytest.raises(CorruptCheckpoint) as e:
        _transfer(image, manifest, digest_offset, 65_537)
    assert e.value.tensor == record.name
