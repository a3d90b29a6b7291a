"""Shared fixtures: real daemon processes, each with its own socket and shm root."""

from __future__ import annotations

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
