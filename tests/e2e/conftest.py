"""Fixtures of the end-to-end tests: real daemon processes, each with its own socket and shm
root, and clusters of them on a real etcd."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ckptcache.api
from tests.helpers import DaemonProc, EtcdServer, new_daemon, wait_until


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


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session (skipped where etcd is not installed)."""
    import shutil

    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (apt-get install etcd-server)")
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.stop()


@pytest.fixture
def cluster_factory(
    daemon_factory: Callable[..., DaemonProc], etcd_server: EtcdServer, tmp_path: Path
) -> Callable[..., list[DaemonProc]]:
    """Start ``n`` daemons as nodes of one fresh cluster on the session's etcd."""
    name = f"c{uuid.uuid4().hex[:8]}"

    def factory(
        n: int,
        *extra: str,
        ttl: float = 2.0,
        secret: str = "s3cret",
        config: str = "",
        etcd: EtcdServer | None = None,
    ) -> list[DaemonProc]:
        """``etcd``: a server of the test's own (one it may stop) instead of the session's."""
        cfg = tmp_path / f"cluster-{name}.yaml"
        cfg.write_text(f"lease_ttl: {ttl}\npersist_retries: 1000\npersist_backoff: 0.2\n"
                       f"persist_backoff_max: 0.5\nsecret: {secret}\n{config}")  # fmt: skip
        nodes = []
        for i in range(n):
            nodes.append(daemon_factory(
                "--config", str(cfg), "--coordinator", (etcd or etcd_server).url, "--cluster", name,
                "--listen", "127.0.0.1:0", "--node-id", f"node{i}", "--host", f"host{i}",
                "--backup", "auto", "--memory-limit", "512MiB", *extra,
            ))  # fmt: skip
        wait_until(lambda: all(len(d.status().cluster_nodes) == n for d in nodes))
        return nodes

    return factory
