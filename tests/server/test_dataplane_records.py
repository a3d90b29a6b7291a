"""The data plane's authenticated records against an attacker who controls the wire.

Two real :class:`Channel` ends with the keys one handshake derives; everything the sender
writes is captured as raw bytes, altered the way a man in the middle could (flip a bit,
reorder, replay, reflect, cut), and fed to the receiver, which must refuse it with
:class:`ChannelTampered` (or, for a cut stream, a :class:`ConnectionError`) and never report
unauthenticated bytes as landed.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading

import pytest

from ckptcache.server.cluster.dataplane import RECORD_SIZE, Channel, ChannelTampered

SECRET = b"k" * 32
TRANSCRIPT = b"transcript"
TAG = 16


def ends() -> tuple[Channel, Channel]:
    """A client and a server channel over a socket pair, keyed from one transcript."""
    a, b = socket.socketpair()
    client = Channel.from_handshake(a, SECRET, TRANSCRIPT, client=True, peer_id="server")
    server = Channel.from_handshake(b, SECRET, TRANSCRIPT, client=False, peer_id="client")
    return client, server


def wire_records(payloads: list[bytes]) -> list[bytes]:
    """The exact bytes a client channel puts on the wire for ``payloads``, one per record."""
    client, server = ends()
    out = []
    for payload in payloads:
        client.send_bytes(payload)
        out.append(_read(server.sock, 4 + len(payload) + TAG))
    client.close()
    server.close()
    return out


def _read(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "closed early"
        buf += chunk
    return buf


def receiver_fed(raw: bytes, *, close: bool = True) -> Channel:
    """A server channel whose peer sends ``raw`` (then hangs up, unless ``close`` is false)."""
    a, b = socket.socketpair()

    def feed() -> None:  # in the background: more than a socket buffer's worth
        try:
            a.sendall(raw)
            if close:
                a.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the receiver gave up (as it should) and closed its end

    threading.Thread(target=feed, daemon=True).start()
    return Channel.from_handshake(b, SECRET, TRANSCRIPT, client=False, peer_id="client")


def test_intact_records_and_bulk_arrive_verified(tmp_path):
    client, server = ends()
    client.send_bytes(b"hello")
    assert server.recv_bytes() == b"hello"
    data = os.urandom(2 * RECORD_SIZE + 12345)
    src = tmp_path / "src"
    src.write_bytes(data)
    dst = bytearray(len(data))
    landed: list[int] = []
    t = threading.Thread(target=client.send_file, args=(str(src), 0, len(data)))
    t.start()
    server.recv_into(memoryview(dst), landed.append)
    t.join()
    assert bytes(dst) == data
    assert landed == [RECORD_SIZE, 2 * RECORD_SIZE, len(data)]
    client.close()
    server.close()


def test_a_flipped_bit_is_refused():
    (record,) = wire_records([b"payload that matters"])
    tampered = bytearray(record)
    tampered[6] ^= 0x01
    with pytest.raises(ChannelTampered, match="record 0 from data-plane peer client failed"):
        receiver_fed(bytes(tampered)).recv_bytes()


def test_a_forged_tag_is_refused():
    (record,) = wire_records([b"payload"])
    with pytest.raises(ChannelTampered, match="failed authentication"):
        receiver_fed(record[:-TAG] + bytes(TAG)).recv_bytes()


def test_reordered_records_are_refused():
    first, second = wire_records([b"first", b"second"])
    receiver = receiver_fed(second + first)
    with pytest.raises(ChannelTampered, match=r"record 0 .* failed authentication"):
        receiver.recv_bytes()


def test_a_replayed_record_is_refused():
    first, second = wire_records([b"grant", b"more"])
    receiver = receiver_fed(first + first + second)
    assert receiver.recv_bytes() == b"grant"
    with pytest.raises(ChannelTampered, match=r"record 1 .* failed authentication"):
        receiver.recv_bytes()


def test_a_dropped_record_is_refused():
    first, _second, third = wire_records([b"a", b"b", b"c"])
    receiver = receiver_fed(first + third)
    assert receiver.recv_bytes() == b"a"
    with pytest.raises(ChannelTampered, match="record 1"):
        receiver.recv_bytes()


def test_a_record_reflected_to_its_sender_is_refused():
    """Each direction has its own key: the client's own record sent back to it fails."""
    (record,) = wire_records([b"echo"])
    a, b = socket.socketpair()
    a.sendall(record)
    client = Channel.from_handshake(b, SECRET, TRANSCRIPT, client=True, peer_id="server")
    with pytest.raises(ChannelTampered):
        client.recv_bytes()


def test_a_record_from_another_connection_is_refused():
    """Keys are bound to the handshake transcript: a record recorded on one connection does
    not authenticate on another."""
    (record,) = wire_records([b"old session"])
    a, b = socket.socketpair()
    a.sendall(record)
    other = Channel.from_handshake(b, SECRET, b"another transcript", client=False, peer_id="c")
    with pytest.raises(ChannelTampered):
        other.recv_bytes()


def test_an_oversize_length_is_refused_before_reading_it():
    with pytest.raises(ChannelTampered, match="oversize record"):
        receiver_fed((1 << 31).to_bytes(4, "big"), close=False).recv_bytes(limit=1 << 20)


def test_tampered_bulk_bytes_never_reach_progress(tmp_path):
    data = os.urandom(3 * RECORD_SIZE)
    src = tmp_path / "src"
    src.write_bytes(data)
    client, capture = ends()
    t = threading.Thread(target=client.send_file, args=(str(src), 0, len(data)))
    t.start()
    raw = bytearray(_read(capture.sock, len(data) + 3 * (4 + TAG)))
    t.join()
    # Flip one byte in the second record's payload.
    raw[(4 + RECORD_SIZE + TAG) + 4 + 100] ^= 0xFF
    dst = bytearray(len(data))
    landed: list[int] = []
    with pytest.raises(ChannelTampered, match=r"record 1 .* failed authentication"):
        receiver_fed(bytes(raw)).recv_into(memoryview(dst), landed.append)
    assert landed == [RECORD_SIZE]  # only the record before the tampered one was released
    client.close()
    capture.close()


def test_bulk_records_swapped_are_refused(tmp_path):
    data = os.urandom(2 * RECORD_SIZE)
    src = tmp_path / "src"
    src.write_bytes(data)
    client, capture = ends()
    t = threading.Thread(target=client.send_file, args=(str(src), 0, len(data)))
    t.start()
    size = 4 + RECORD_SIZE + TAG
    raw = _read(capture.sock, 2 * size)
    t.join()
    dst = bytearray(len(data))
    landed: list[int] = []
    with pytest.raises(ChannelTampered, match="record 0"):
        receiver_fed(raw[size:] + raw[:size]).recv_into(memoryview(dst), landed.append)
    assert landed == []
    client.close()
    capture.close()


def test_a_cut_stream_is_an_error_not_a_short_copy(tmp_path):
    data = os.urandom(RECORD_SIZE + 1000)
    src = tmp_path / "src"
    src.write_bytes(data)
    client, capture = ends()
    t = threading.Thread(target=client.send_file, args=(str(src), 0, len(data)))
    t.start()
    raw = _read(capture.sock, len(data) + 2 * (4 + TAG))
    t.join()
    dst = bytearray(len(data))
    landed: list[int] = []
    with pytest.raises(ConnectionError, match="closed the connection mid-transfer"):
        receiver_fed(raw[: 4 + RECORD_SIZE + TAG + 4 + 500]).recv_into(
            memoryview(dst), landed.append
        )
    assert landed in ([], [RECORD_SIZE])  # never a byte of the cut record
    client.close()
    capture.close()


def test_a_record_is_reported_landed_before_the_next_one_arrives(tmp_path):
    """A relay forwards what has landed: each record is released once it is in and checked,
    not when the next record is in (the sender here waits for that report before it sends
    the next one; holding reports back until then would stall the stream)."""
    record = 64 << 10
    data = os.urandom(3 * record)
    src = tmp_path / "src"
    src.write_bytes(data)
    client, server = ends()
    landed: list[int] = []
    released = threading.Condition()

    def report(n: int) -> None:
        with released:
            landed.append(n)
            released.notify_all()

    def send() -> None:
        for i in range(3):
            client.send_file(str(src), i * record, record, record=record)
            with released:  # the next record only once the receiver released this one
                if not released.wait_for(lambda i=i: len(landed) > i, timeout=20):
                    client.sock.shutdown(socket.SHUT_RDWR)  # held back: end the stream
                    return

    sender = threading.Thread(target=send)
    sender.start()
    try:
        server.recv_into(memoryview(bytearray(len(data))), report)
    except ConnectionError:
        pass  # asserted below: what was released before the stream ended
    sender.join()
    assert landed == [record, 2 * record, 3 * record]
    client.close()
    server.close()


def test_pages_sent_by_sendfile_stay_unchanged_until_the_peer_has_read_them(tmp_path):
    """``sendfile`` over TCP is zero copy: what it queued still references the file's pages
    until the peer reads them, so a segment reused as soon as the send returned reached the
    peer as the next save's bytes, under the first one's tag. :meth:`Channel.until_read`
    returns only once the peer has read everything (here: hung up): the sender changes the
    pages only then, while the peer waits a second before it reads at all."""
    n = 1 << 20
    path = str(tmp_path / "segment")
    with open(path, "wb") as f:
        f.write(b"C" * n)
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    for s in (a, b):  # room for the whole record in the queues: sendfile returns at once
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    client = Channel.from_handshake(a, SECRET, TRANSCRIPT, client=True, peer_id="server")
    server = Channel.from_handshake(b, SECRET, TRANSCRIPT, client=False, peer_id="client")
    released = threading.Event()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), n) as mapping:

        def send() -> None:
            client.send_file(f.fileno(), 0, n, mapping)
            client.until_read(30.0)
            mapping[:] = b"D" * n  # the segment handed to the next save
            released.set()

        sender = threading.Thread(target=send)
        sender.start()
        released.wait(1.0)  # a sender that let go at once has written the pages by now
        got = bytearray(n)
        server.recv_into(memoryview(got))
        server.close()
        sender.join()
    assert bytes(got) == b"C" * n
    client.close()
