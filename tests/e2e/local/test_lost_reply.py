"""A generation already on S3 is never written a second time.

A persist whose write landed on S3 but whose reply was lost (the connection closed after S3
took the request): botocore sends it again, S3 refuses the retry's condition (the object is no
longer the one checked), and the persist sees a failure. The object on storage is this very
generation, so the persist is done: it is reported persisted. The same when the object was
written by another holder of the generation while this node could not reach storage.

Real daemon, real S3 endpoint (moto's server over HTTP) behind a proxy that forwards the first
write of the object and then closes the daemon's connection instead of replying, or answers
every request 503 while storage is to be unreachable."""

from __future__ import annotations

import http.client
import io
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from ckptcache.format.layout import SegmentHeader
from ckptcache.storage.base import COMMIT_NS_KEY
from tests.e2e.local.test_incremental_persist import config
from tests.helpers import assert_same, wait_until

MiB = 1 << 20


class LosesFirstReply:
    """An HTTP proxy to S3 that forwards everything and, for the first request whose method
    and query ``lose`` names, closes the client's connection instead of forwarding S3's reply
    (``lost`` counts them); :attr:`down` makes S3 unreachable."""

    def __init__(self, target_port: int, lose: tuple[str, str] = ("", "")):
        self.target_port, self.lose, self.lost = target_port, lose, 0
        #: While set, every request is answered 503 (storage unreachable).
        self.down = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                size = int(self.headers.get("Content-Length", 0) or 0)
                body = self.rfile.read(size) if size else b""
                proxy.forward(self, body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _losing(self, handler: BaseHTTPRequestHandler) -> bool:
        method, query = self.lose
        path, _, rest = handler.path.partition("?")
        if not method or handler.command != method or not path.endswith("/model.pt") or self.lost:
            return False
        # A whole-object PUT has no query; a completion's POST names its upload only.
        return rest.startswith(query) if query else "partNumber" not in rest and not rest

    def forward(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        if self.down:
            handler.send_response(503)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.target_port, timeout=60)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() != "host"}
            headers["Host"] = f"127.0.0.1:{self.target_port}"
            upstream.request(handler.command, handler.path, body or None, headers)
            reply = upstream.getresponse()
            data = reply.read()
        finally:
            upstream.close()
        if self._losing(handler) and reply.status == 200:
            self.lost += 1  # S3 did it; the writer never hears so
            handler.close_connection = True
            return
        handler.send_response(reply.status)
        for k, v in reply.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date",
                                 "server"):  # fmt: skip
                handler.send_header(k, v)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=[("PUT", ""), ("POST", "uploadId=")], ids=["put", "completion"])
def proxy(request: pytest.FixtureRequest, s3_server) -> Iterator[LosesFirstReply]:
    p = LosesFirstReply(s3_server.port, request.param)
    yield p
    p.close()


def test_a_write_whose_reply_was_lost_is_persisted_once(
    daemon_factory, tmp_path, s3_server, s3_bucket, proxy
):
    s3 = s3_server.client()
    s3.put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    d = daemon_factory("--persist-root", f"s3://{s3_bucket}/a", "--s3-endpoint-url",
                       proxy.endpoint, "--config", config(tmp_path, s3_part_size="5MiB"))  # fmt: skip
    url = f"s3://{s3_bucket}/a/model.pt"
    # One PUT below a part, a multipart upload above.
    size = MiB if proxy.lose[0] == "PUT" else 12 * MiB
    obj = {"w": torch.arange(size // 4, dtype=torch.float32), "step": 1}
    with d.client() as c:
        c.save(obj, url)
        c.wait(url, timeout=60)
        assert proxy.lost == 1  # the write landed and its reply never came
        assert c.status(url).persist_state == "persisted"
    wait_until(lambda: "persist" in d.log(), 10, "the daemon's log")
    versions = s3.list_object_versions(Bucket=s3_bucket, Prefix="a/model.pt")["Versions"]
    assert len(versions) == 1, [v["VersionId"] for v in versions]
    data = s3.get_object(Bucket=s3_bucket, Key="a/model.pt")["Body"].read()
    assert_same(obj, torch.load(io.BytesIO(data), weights_only=True))
    assert s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_a_generation_another_holder_wrote_meanwhile_is_not_written_again(
    daemon_factory, tmp_path, s3_server, s3_bucket
):
    """Storage is unreachable at the persist's first attempt, which takes the object's base
    from storage; meanwhile another holder of the generation writes it (a put with the
    generation's stamp stands in for it). Once storage answers, the persist finds its own
    generation there: taken as a base, it would be replaced by itself under a later stamp."""
    s3 = s3_server.client()
    s3.put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    proxy = LosesFirstReply(s3_server.port)
    try:
        cfg = config(tmp_path, persist_retries=1000, persist_backoff=0.2, persist_backoff_max=0.5)
        d = daemon_factory("--persist-root", f"s3://{s3_bucket}/a", "--s3-endpoint-url",
                           proxy.endpoint, "--config", cfg)  # fmt: skip
        url = f"s3://{s3_bucket}/a/model.pt"
        obj = {"w": torch.arange(1 << 18, dtype=torch.float32), "step": 1}
        with d.client() as c:
            proxy.down = True
            c.save(obj, url)
            wait_until(lambda: "failed (attempt" in d.log(), 60, "a failed persist attempt")
            with open(os.path.join(d.segments_dir, c.status(url).segment), "rb") as f:
                stamp = SegmentHeader.unpack(f.read(4096)).committed_ns
            buf = io.BytesIO()
            torch.save(obj, buf)
            s3.put_object(Bucket=s3_bucket, Key="a/model.pt", Body=buf.getvalue(),
                          Metadata={COMMIT_NS_KEY: str(stamp)})  # fmt: skip
            proxy.down = False
            c.wait(url, timeout=60)
            assert c.status(url).persist_state == "persisted"
        versions = s3.list_object_versions(Bucket=s3_bucket, Prefix="a/model.pt")["Versions"]
        assert len(versions) == 1, [v["VersionId"] for v in versions]
        assert "on storage already" in d.log()
    finally:
        proxy.close()
