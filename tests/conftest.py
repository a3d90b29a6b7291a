"""Shared fixtures: real daemon processes, each with its own socket and shm root."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ckptcache.api
from tests.helpers import DaemonProc, new_daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    """Start daemons on demand (``factory("--memory-limit", "64MiB")``); all stopped afterwards."""
    started: list[DaemonProc] = []

    def factory(*args: str, start: bool = True, **kw: object) -> DaemonProc:
        d = new_daemon(tmp_path, *args, **kw)  # type: ignore[arg-type]
        started.append(d)
        return d.start() if start else d

    yield factory
    for d in started:
        d.cleanup()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProc]) -> DaemonProc:
    """One running daemon with a 1 GiB budget."""
    return daemon_factory("--memory-limit", "1GiB")


@pytest.fixture
def client(daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> Iterator[ckptcache.Client]:
    """A client of ``daemon``, also installed as the process default (for ckptcache.save)."""
    monkeypatch.setenv("CKPTCACHE_SOCKET", daemon.socket)
    c = daemon.client()
    ckptcache.api.set_default_client(c)
    yield c
    ckptcache.api.set_default_client(None)


class S3Server:
    """moto's S3 in server mode on loopback: real HTTP, driven through boto3."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

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
