"""The cache's status (``ckptcache.status()`` with no path): a missing daemon is an answer, with the fallbacks counted."""

from __future__ import annotations

import warnings

import torch

from ckptcache.client import CacheStatus, Client
from ckptcache.client._health import cache_status


def test_describe_says_what_a_missing_daemon_does():
    up = CacheStatus(True, "/s.sock", "job", "write-through")
    assert up.describe() == "cache reachable at /s.sock (namespace 'job')"
    down = CacheStatus(False, "/s.sock", "job", "raise", error="refused")
    assert down.describe() == "cache NOT reachable at /s.sock: refused; saves fail"
    through = CacheStatus(False, "/s.sock", "job", "write-through", error="refused")
    assert through.describe().endswith("saves write through to storage")


def test_a_client_without_daemon_writes_through_and_reports_it(tmp_path):
    sock = str(tmp_path / "none.sock")
    path = tmp_path / "step_1.pt"
    with Client(sock, namespace="t", timeout=5) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        client.save({"w": torch.ones(3)}, str(path))
        status = cache_status(client)
        assert isinstance(status, CacheStatus)
        assert not status.reachable and status.error
        assert (status.socket, status.namespace, status.fallbacks) == (sock, "t", 1)
        assert client.fallbacks == 1
    assert torch.equal(torch.load(path)["w"], torch.ones(3))
