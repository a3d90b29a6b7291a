"""The lab's S3 endpoint (tests/lab_s3.py): ranged GETs served by seek and read return exactly
moto's bytes and errors, through boto3 against the launcher's real HTTP server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto.server")

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from ckptcache.cli.benchmarking import free_port
from tests.lab_s3 import ObjectView, patch_moto

REPO = Path(__file__).resolve().parents[3]
#: Above moto's in-memory limit (5 MiB): stored in a file, so ranges are read with pread.
BIG = 12 << 20
BUCKET = "ranges"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """The launcher's server on loopback, with one big and one small object stored."""
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.lab_s3", "-H", "127.0.0.1", "-p", str(port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
            aws_access_key_id="t", aws_secret_access_key="t",
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        client.put_object(Bucket=BUCKET, Key="big", Body=_content(BIG))
        client.put_object(Bucket=BUCKET, Key="small", Body=_content(1000))
        yield client
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _content(n: int) -> bytes:
    """Bytes whose every 8-byte word says where it is: a misplaced range cannot match."""
    words = (n + 7) // 8
    return b"".join(i.to_bytes(8, "little") for i in range(words))[:n]


def _get(s3: Any, key: str, rng: str, bucket: str = BUCKET) -> tuple[bytes, str]:
    out = s3.get_object(Bucket=bucket, Key=key, Range=rng)
    return out["Body"].read(), out["ContentRange"]


@pytest.mark.parametrize("key, size", [("big", BIG), ("small", 1000)])
def test_ranged_get_returns_the_exact_bytes(s3: Any, key: str, size: int) -> None:
    data = _content(size)
    mid = size // 2 - 3
    cases = {
        "bytes=0-99": (0, 99),  # start
        f"bytes={mid}-{mid + 4096}": (mid, min(mid + 4096, size - 1)),  # middle, unaligned
        f"bytes={size - 10}-{size - 1}": (size - 10, size - 1),  # end
        f"bytes={size - 5}-": (size - 5, size - 1),  # open-ended
        "bytes=-7": (size - 7, size - 1),  # suffix
        f"bytes=5-{size + 1000}": (5, size - 1),  # past the end: clamped, as S3 does
        f"bytes={size - 1}-{size - 1}": (size - 1, size - 1),  # one byte
    }
    for rng, (first, last) in cases.items():
        body, content_range = _get(s3, key, rng)
        assert body == data[first : last + 1], rng
        assert content_range == f"bytes {first}-{last}/{size}", rng
    whole = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert whole == data


@pytest.mark.parametrize("key, size", [("big", BIG), ("small", 1000)])
def test_range_past_the_end_is_416(s3: Any, key: str, size: int) -> None:
    with pytest.raises(ClientError) as err:
        _get(s3, key, f"bytes={size}-{size + 10}")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 416
    assert err.value.response["Error"]["Code"] == "InvalidRange"


def test_a_range_moto_ignores_answers_the_whole_object(s3: Any) -> None:
    """Several ranges in one header: moto (like S3 for this case) answers 200 and every
    byte; the launcher turns the view it made for the range into those bytes."""
    out = s3.get_object(Bucket=BUCKET, Key="big", Range="bytes=0-9,20-29")
    assert out["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert out["Body"].read() == _content(BIG)


def test_a_ranged_get_does_not_read_the_whole_object() -> None:
    """In process (the same patch): with the stored file's whole-object read disabled, a
    ranged GET still returns its bytes, and only a whole GET fails."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    patch_moto()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        client = boto3.client(
            "s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
            aws_access_key_id="t", aws_secret_access_key="t",
            config=Config(retries={"max_attempts": 1}),
        )  # fmt: skip
        client.create_bucket(Bucket="inproc")
        client.put_object(Bucket="inproc", Key="big", Body=_content(BIG))
        key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].buckets["inproc"].keys["big"]

        def no_whole_reads(*args: object) -> bytes:
            raise AssertionError("the whole stored object was read")

        key._value_buffer.read = no_whole_reads
        body, _ = _get(client, "big", "bytes=4096-8191", bucket="inproc")
        assert body == _content(BIG)[4096:8192]
        with pytest.raises(ClientError):
            client.get_object(Bucket="inproc", Key="big")
    finally:
        server.stop()


def test_object_view_reads_slices_from_its_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "obj"
    data = _content(1 << 20)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    view = ObjectView(fd, len(data))
    assert len(view) == len(data) and bool(view)
    assert view[10:20] == data[10:20]
    assert view[len(data) - 3 :] == data[-3:]
    assert bytes(view) == data
    with pytest.raises(TypeError):
        view[::2]
    view.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the view
