"""A push split into stripes, each on a connection of its own: the same bytes and digests as
one connection, relays still see a growing prefix, and a stripe cut off mid-transfer or
tampered with fails the whole transfer, typed, with no stripe left writing into the view."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.errors import CkptCacheError, CorruptCheckpoint
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import Manifest, compute_digests, pack_digests
from ckptcache.server.cluster import stripes
from ckptcache.server.cluster.dataplane import Channel, ChannelTampered, recv_msg
from ckptcache.server.cluster.transfer import receive_copy, send_stripe, send_striped, serve_stripe
from ckptcache.wire import peer


def _image(tmp_path: Path) -> tuple[Path, Manifest, Any]:
    """A segment image on disk with its digest table, storages of odd sizes (one empty)."""
    g = torch.Generator().manual_seed(3)
    obj = {f"t{i}": torch.randn(100_003 + 7919 * i, generator=g) for i in range(10)}
    obj["empty"] = torch.ones(0)
    flat = flatten(obj)
    plan = plan_object(flat, "/ckpt/model.pt", "default")
    image = bytearray(plan.layout.nbytes)
    write_object(memoryview(image), plan, flat)  # type: ignore[arg-type]
    table = compute_digests(memoryview(image), plan.manifest)
    off = plan.layout.digest_offset
    image[off : off + 8 * len(table)] = pack_digests(table)
    path = tmp_path / "segment"
    path.write_bytes(image)
    return path, plan.manifest, plan


class _Segment:
    """What the sending side reads of a generation's segment."""

    def __init__(self, path: Path, digest_offset: int):
        self.path, self.mapping = path, None
        self.header = SimpleNamespace(digest_offset=digest_offset)

    def read_header(self) -> Any:
        return self.header

    @contextlib.contextmanager
    def opened(self) -> Iterator[int]:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            yield fd
        finally:
            os.close(fd)


def _pair(peer_id: str = "origin") -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return (Channel(a, b"k" * 32, b"r" * 32, peer_id="backup"),
            Channel(b, b"r" * 32, b"k" * 32, peer_id=peer_id))  # fmt: skip


def _push(
    tmp_path: Path,
    streams: int,
    *,
    spoil: Callable[[int, Channel], None] | None = None,
) -> tuple[bytes, Manifest, bytes, list[int], list[int], list[BaseException]]:
    """A striped push of a test image from a sending thread to ``receive_copy`` here.
    ``spoil(index, channel)`` may break stripe ``index``'s sending channel before it sends.
    Returns the image, its manifest, the body that landed, the verified digests, the progress
    reports and the sender's errors."""
    path, manifest, plan = _image(tmp_path)
    image = path.read_bytes()
    gen = SimpleNamespace(segment=_Segment(path, plan.layout.digest_offset))
    digests = compute_digests(memoryview(bytearray(image)), manifest)
    sinks, token = stripes.Sinks(), "t0ken"
    primary_send, primary_recv = _pair()
    served: list[threading.Thread] = []
    sent_errors: list[BaseException] = []

    def stripe(index: int, lo: int, hi: int) -> None:
        send, recv = _pair()

        def serve() -> None:
            with contextlib.suppress(OSError, CkptCacheError):
                serve_stripe(sinks, recv, peer.decode_request(recv_msg(recv)))  # type: ignore[arg-type]
            recv.close()

        t = threading.Thread(target=serve)
        t.start()
        served.append(t)
        try:
            if spoil is not None:
                spoil(index, send)
            send_stripe(send, gen, token, index, lo, hi)  # type: ignore[arg-type]
        finally:
            send.close()

    def sender() -> None:
        try:
            ack = peer.decode_ack(recv_msg(primary_send))
            assert isinstance(ack, peer.Ack)
            if len(ack.stripes) > 1:
                send_striped(primary_send, gen, lambda: digests, list(ack.stripes), stripe)  # type: ignore[arg-type]
            else:
                send_striped(primary_send, gen, lambda: digests, [0], stripe)  # type: ignore[arg-type]
        except BaseException as e:
            sent_errors.append(e)
        finally:
            primary_send.close()  # a failed sender hangs up: the receiver stops

    head = peer.PushRequest(
        namespace="default", path="/ckpt/model.pt", nbytes=plan.layout.nbytes,
        manifest_offset=plan.layout.manifest_offset, manifest_size=len(plan.manifest_bytes),
        origin="origin", manifest=plan.manifest_bytes.decode(), skeleton_digest=0,
        committed=1.0, streams=streams, token=token,
    )  # fmt: skip
    landed = bytearray(len(image) - HEADER_SIZE)
    reports: list[int] = []

    verified: list[int] = []

    def receive(copy: Any) -> Any:  # what Ingest.receive is given
        copy.fill(memoryview(landed), reports.append)
        verified.extend(copy.digests())

    t = threading.Thread(target=sender)
    t.start()
    try:
        receive_copy(primary_recv, head, receive, "origin", ready=True, streams=streams,
                     striped=lambda s: sinks.open(token, s))  # fmt: skip
    finally:
        t.join(30)
        for s in served:
            s.join(30)
        primary_recv.close()
    return image, manifest, bytes(landed), verified, reports, sent_errors


@pytest.fixture(autouse=True)
def small_stripes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stripes of 256 KiB, so that a test object of a few MiB splits."""
    monkeypatch.setattr(stripes, "MIN_STRIPE", 256 << 10)


def test_plan_splits_the_body_in_aligned_stripes(tmp_path: Path) -> None:
    _path, manifest, plan = _image(tmp_path)
    body = plan.layout.digest_offset - HEADER_SIZE
    for streams in (1, 2, 3, 4, 8, 64):
        cuts = stripes.plan(manifest, body, streams)
        assert cuts[0] == 0 and len(cuts) <= streams
        assert cuts == sorted(set(cuts))
        assert all(c % stripes.ALIGN == 0 for c in cuts)
        spans = stripes.ranges(cuts, body)
        assert spans[-1][1] == body
        assert all(hi - lo >= stripes.MIN_STRIPE for lo, hi in spans[:-1])
    assert stripes.plan(manifest, body, 8, min_stripe=body) == [0]
    assert len(stripes.plan(manifest, body, 4)) == 4


@pytest.mark.parametrize("streams", [1, 2, 4, 7])
def test_stripes_deliver_the_same_bytes_and_digests(tmp_path: Path, streams: int) -> None:
    image, manifest, landed, verified, reports, errors = _push(tmp_path, streams)
    assert errors == []
    assert landed == image[HEADER_SIZE:]
    assert verified == compute_digests(memoryview(bytearray(image)), manifest)
    assert reports == sorted(reports) and reports[-1] == len(image) - HEADER_SIZE


def test_a_stripe_cut_off_fails_the_transfer(tmp_path: Path) -> None:
    """A partition of one stripe's connection: the receiver fails typed, every stripe stops."""

    def cut(index: int, channel: Channel) -> None:
        if index == 2:
            channel.sock.shutdown(socket.SHUT_RDWR)

    with pytest.raises((OSError, CkptCacheError)):
        _push(tmp_path, 4, spoil=cut)
    assert {t.name for t in threading.enumerate() if t.name.startswith("stripe")} == set()


def test_a_tampered_stripe_fails_the_transfer(tmp_path: Path) -> None:
    """A stripe whose records are keyed wrong (as if altered on the wire): refused, typed."""

    def forge(index: int, channel: Channel) -> None:
        if index == 1:
            channel._send_key = b"x" * 32

    with pytest.raises((ChannelTampered, CorruptCheckpoint, ConnectionError)):
        _push(tmp_path, 3, spoil=forge)


def test_a_stripe_from_another_node_is_refused() -> None:
    sinks = stripes.Sinks()
    own, other = _pair("origin")[1], _pair("intruder")[1]
    sink = stripes.StripeSink(memoryview(bytearray(8)), SimpleNamespace(storages=[], path="/p"), [0, 4], 8,
                              "origin", lambda n: None)  # fmt: skip
    with sinks.open("tok", sink):
        assert sinks.join("tok", 1, other) is None
        assert sinks.join("nope", 1, own) is None
        assert sinks.join("tok", 1, own) is sink
        assert sinks.join("tok", 1, own) is None  # a stripe is taken once
        sink.release(own)
    for ch in (own, other):
        ch.close()
