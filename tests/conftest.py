"""Fixtures every folder may use: the S3 endpoint (moto's server in this process), which the
storage backends' conformance suite and the end-to-end tests share. The daemon and cluster
fixtures live in ``tests/e2e/conftest.py``: the per-part tests build what they test in process."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

# Skips fail the run where CKPTCACHE_REQUIRE_ALL is set (scripts/test.sh), GPU tests aside.
pytest_plugins = ["tests._require_all"]

# A persist-state change the daemon's table does not list raises in every daemon the suite
# builds or starts (inherited by their processes), so the whole suite proves the table
# complete; production applies, logs and counts one (ckptcache.server.persist.states).
os.environ["CKPTCACHE_STRICT_STATES"] = "1"


class S3Server:
    """moto's S3 in server mode on loopback: real HTTP, driven through boto3. Ranged GETs are
    served by seek and read, as the lab's endpoint serves them (tests/lab_s3.py)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        from tests.lab_s3 import patch_moto

        patch_moto()

        self._server_cls = ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.port = port
        self.endpoint = f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        """Start again on the same port (the stored objects survive: moto keeps them)."""
        self.server = self._server_cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def client(self) -> object:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3 endpoint for the session; credentials and endpoint exported for every process."""
    pytest.importorskip("moto.server")
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL_S3"]}
    os.environ.update(env)
    server = S3Server()
    os.environ["AWS_ENDPOINT_URL_S3"] = server.endpoint
    yield server
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh bucket (valid DNS name) on the session's S3 endpoint."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
    return name
