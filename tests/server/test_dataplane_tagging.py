"""Record tags and the digests taken in the same pass: the C pass (where the record extension is
built) and the Python one give the same tags as ``cryptography``'s Poly1305 and the same digests
as :func:`digest_bytes`, whatever the storages' layout across records, and a receiver hands no
digest on from a record whose tag fails."""

from __future__ import annotations

import itertools
import os
import socket
import threading

import pytest
from cryptography.hazmat.primitives.poly1305 import Poly1305

from ckptcache.format.digest import digest_bytes
from ckptcache.server.cluster.dataplane import Channel, ChannelTampered, Span, Xxh3, _tagging

SECRET = b"k" * 32


@pytest.fixture(params=["extension", "python"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs on the extension (skipped where it is not built) and on the fallback."""
    if request.param == "extension":
        if _tagging._EXT is None:
            pytest.skip("record extension not built")
    else:
        monkeypatch.setattr(_tagging, "_EXT", None)
    return str(request.param)


def _poly(key: bytes, head: bytes, data: bytes) -> bytes:
    poly = Poly1305(key)
    poly.update(head)
    poly.update(data)
    return poly.finalize()


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, (128 << 10) + 3, (1 << 20) + 5])
def test_tag_is_poly1305(implementation: str, size: int) -> None:
    key, head, data = os.urandom(32), b"\x00\x01\x02\x03", os.urandom(size)
    assert _tagging.tag(key, head, memoryview(data)) == _poly(key, head, data)


def test_spans_hash_across_records(implementation: str) -> None:
    """Storages that start, end and span record boundaries (and empty ones) hash as a whole."""
    data = memoryview(os.urandom(3 << 20))
    # (lo, hi) of each storage over the whole stream, with gaps between some.
    storages = [(0, 10), (10, 10), (64, (1 << 20) + 7), ((1 << 20) + 7, (2 << 20) + 300001),
                ((2 << 20) + 300001, (2 << 20) + 300001), ((2 << 20) + 400000, 3 << 20)]  # fmt: skip
    bounds = [0, 5, 1 << 20, (1 << 20) + 7, (2 << 20) + 300001, 3 << 20]
    state, got = Xxh3(), []
    key, head = os.urandom(32), b"head"
    planned = 0
    for start, end in itertools.pairwise(bounds):
        spans: list[Span] = []
        while planned < len(storages):
            lo, hi = storages[planned]
            if lo >= end and not (lo == hi == end):
                break
            ends = hi <= end
            spans.append((max(lo, start) - start, min(hi, end) - start, ends))
            if not ends:
                break
            planned += 1
        tag, digests = _tagging.tag_and_hash(key, head, data[start:end], spans, state)
        assert tag == _poly(key, head, bytes(data[start:end]))
        got.extend(digests)
    assert got == [digest_bytes(data[lo:hi]) for lo, hi in storages]


class _Hasher:
    """A receiver's digests of fixed storages, as the transfer's hasher takes them."""

    def __init__(self, storages: list[tuple[int, int]]):
        self.storages, self.planned, self.state = storages, 0, Xxh3()
        self.digests: list[int] = []

    def spans(self, start: int, end: int) -> list[Span]:
        out: list[Span] = []
        while self.planned < len(self.storages):
            lo, hi = self.storages[self.planned]
            if lo >= end:
                break
            ends = hi <= end
            out.append((max(lo, start) - start, min(hi, end) - start, ends))
            if not ends:
                break
            self.planned += 1
        return out

    def hashed(self, digests: list[int]) -> None:
        self.digests.extend(digests)


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    client = Channel.from_handshake(a, SECRET, b"t", client=True, peer_id="server")
    server = Channel.from_handshake(b, SECRET, b"t", client=False, peer_id="client")
    return client, server


def test_channel_digests_what_it_receives(implementation: str, tmp_path: object) -> None:
    payload = os.urandom((5 << 20) + 123)
    path = os.path.join(str(tmp_path), "src")
    with open(path, "wb") as f:
        f.write(payload)
    storages = [(0, 1 << 20), (1 << 20, (3 << 20) + 1), ((3 << 20) + 9, len(payload))]
    client, server = _pair()
    sender = threading.Thread(target=client.send_file, args=(path, 0, len(payload)),
                              kwargs={"record": (1 << 20) + 17})  # fmt: skip
    sender.start()
    view = memoryview(bytearray(len(payload)))
    hasher, landed = _Hasher(storages), []
    server.recv_into(view, landed.append, hasher)
    sender.join()
    client.close()
    server.close()
    assert bytes(view) == payload
    assert hasher.digests == [digest_bytes(payload[lo:hi]) for lo, hi in storages]
    assert landed[-1] == len(payload)


def test_no_digest_from_a_tampered_record(implementation: str) -> None:
    """A record whose payload was altered on the wire: refused, and its digests never used."""
    client, server = _pair()
    a, b = socket.socketpair()
    client_sock, client.sock = client.sock, a  # capture the wire bytes
    client.send_bytes(b"x" * 1000)
    raw = bytearray(b.recv(4096))
    raw[10] ^= 1
    client_sock.sendall(bytes(raw))
    hasher = _Hasher([(0, 1000)])
    with pytest.raises(ChannelTampered):
        server.recv_into(memoryview(bytearray(1000)), None, hasher)
    assert hasher.digests == []
    for sock in (a, b, client_sock):
        sock.close()
    server.close()
