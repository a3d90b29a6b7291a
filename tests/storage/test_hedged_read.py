"""A stalled first range of a relayed S3 read is asked for again, and only the request that
took it over writes its bytes (``format/hedged_read.py``).

A real HTTP proxy sits in front of moto's S3 server and holds the first ranged GET of the
object after its first piece: the fault the cluster lab showed (a flow stuck in its
retransmission timer while the ranges after it land). When the hedge's request arrives the
proxy lets the held response go on, with every byte flipped, before it answers the hedge: a
stalled original's late bytes, which must never land.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ckptcache.format.archive_read import BLOCK, read_archive
from ckptcache.format.persisted import check_archive, stream_archive
from ckptcache.storage import StorageOptions
from ckptcache.storage.s3 import S3Backend

#: How long the proxy holds the first range when nothing asks for it again.
HOLD = 10.0
KEY = "held.pt"


class StallingProxy(ThreadingHTTPServer):
    """Forwards every request to ``upstream``; the first ranged GET of :data:`KEY` from byte 0
    is held after its first ``piece`` bytes until another request for part of that range
    arrives (or :data:`HOLD` seconds pass); it then sends the rest flipped."""

    daemon_threads = True

    def __init__(self, upstream: str, piece: int):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream.removeprefix("http://")
        self.piece = piece
        self.ranges: list[str] = []  # Range headers of the object's GETs, in arrival order
        self.lock = threading.Lock()
        self.held = False
        self.first_end = -1  # the held range's last byte
        self.hedge_arrived = threading.Event()
        self.late_sent = threading.Event()  # the held response's flipped rest was sent
        self.late_reached_socket = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StallingProxy

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._forward()

    def do_PUT(self) -> None:
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def do_GET(self) -> None:
        rng = self.headers.get("Range", "")
        role = ""
        if self.path.endswith(KEY) and rng:
            start, _, end = rng.removeprefix("bytes=").partition("-")
            with self.server.lock:
                self.server.ranges.append(rng)
                if not self.server.held and start == "0":
                    self.server.held, self.server.first_end, role = True, int(end), "held"
                elif self.server.held and end == str(self.server.first_end):
                    role = "hedge"  # the rest of the held range, asked for again
        if role == "hedge":
            self.server.hedge_arrived.set()
            self.server.late_sent.wait(HOLD)  # the stalled original speaks first
        self._forward(held=role == "held")

    def _forward(self, held: bool = False) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        conn = http.client.HTTPConnection(self.server.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        conn.request(self.command, self.path, body=body, headers=headers)
        reply = conn.getresponse()
        data = reply.read()
        conn.close()
        self.send_response(reply.status)
        for k, v in reply.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not held:
            self.wfile.write(data)
            return
        piece = self.server.piece
        self.wfile.write(data[:piece])
        self.wfile.flush()
        self.server.hedge_arrived.wait(HOLD)
        try:
            self.wfile.write(bytes(b ^ 0xFF for b in data[piece:]))
            self.wfile.flush()
            self.server.late_reached_socket = True
        except OSError:
            pass  # the reader shut the connection: the late bytes never even reached it
        finally:
            self.server.late_sent.set()
        self.close_connection = True


def archive(mib: int) -> bytes:
    """A persisted archive (digest record, CRC-32s) of about ``mib`` MiB."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.randn(mib << 18, generator=torch.Generator().manual_seed(3))}, buf)
    out = bytearray()
    stream_archive(memoryview(buf.getvalue()), out.extend, path="mem")
    return bytes(out)


@pytest.fixture
def proxy(s3_server: Any) -> Iterator[StallingProxy]:
    server = StallingProxy(s3_server.endpoint, BLOCK)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.hedge_arrived.set()
    server.late_sent.set()
    server.shutdown()
    server.server_close()


def test_a_stalled_first_range_is_hedged_and_the_late_bytes_never_land(proxy, s3_server, s3_bucket):
    data = archive(12)  # ranges of 2 MiB on 2 threads, tapering to 1 MiB at the end
    s3_server.client().put_object(Bucket=s3_bucket, Key=KEY, Body=data)
    backend = S3Backend(StorageOptions(s3_endpoint_url=proxy.url))
    url = f"s3://{s3_bucket}/{KEY}"
    view = bytearray(len(data))
    wrong: list[int] = []

    def advance(n: int) -> None:  # what a relay would send at this point
        if bytes(view[:n]) != data[:n]:
            wrong.append(n)

    digests = read_archive(backend, url, memoryview(view), advance=advance, concurrency=2,
                           chunk=2 * BLOCK, prefix_first=True)  # fmt: skip

    assert bytes(view) == data
    assert digests == check_archive(memoryview(data), "mem", deep=True)
    assert wrong == []  # no prefix ever reported held a byte that was not the object's
    held = proxy.ranges.index(f"bytes=0-{2 * BLOCK - 1}")  # after the archive's tail
    hedges = [r for r in proxy.ranges[held + 1 :] if r.endswith(f"-{2 * BLOCK - 1}")]
    # One hedge, for what the original had not put in place (its first piece, or all of it
    # if the stall was seen before that piece was read); its bytes are the ones in place: the
    # original's rest came, flipped, before the hedge was answered.
    assert len(hedges) == 1 and hedges[0] in (
        f"bytes={BLOCK}-{2 * BLOCK - 1}", f"bytes=0-{2 * BLOCK - 1}"
    ), proxy.ranges  # fmt: skip
    assert proxy.late_sent.is_set()
