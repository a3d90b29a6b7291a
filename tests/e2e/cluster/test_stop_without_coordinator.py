"""Stopping a cluster daemon whose coordinator is gone: etcd killed, or hung (SIGSTOP: its
connections neither answer nor close). SIGTERM still ends the daemon promptly and cleanly
(exit 0, socket removed, "stopped" logged), and a save not yet persisted is not lost: the next
start persists it once etcd is back."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import DaemonProc, EtcdServer, assert_same, wait_until

#: Safety net for one stop. A healthy stop takes a fraction of a second and one with a hung
#: etcd about a second and a half (a short, single lease-revoke attempt); a daemon that waits
#: out etcd's client timeout on its way out takes longer than this.
STOP_TIMEOUT = 5.0


def state(seed: int, n: int = 1 << 14) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd this test may kill, stop (SIGSTOP) and start again (same data and port)."""
    (tmp_path / "etcd").mkdir()
    server = EtcdServer(tmp_path / "etcd" / "data").start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
    server.stop()


def stop(node: DaemonProc) -> int:
    """SIGTERM ``node`` and return its exit code (the test fails if it is still up after
    :data:`STOP_TIMEOUT`; it is then killed)."""
    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    try:
        return node.proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        node.kill()
        pytest.fail(f"{node.workdir.name} was still running {STOP_TIMEOUT}s after SIGTERM")


def lose_coordinator_and_stop(
    own_etcd: EtcdServer, cluster_factory, tmp_path: Path, how: signal.Signals
) -> None:
    root = tmp_path / "ckpt"
    nodes = cluster_factory(2, "--persist-root", str(root), etcd=own_etcd)
    done, pending = root / "done.pt", root / "pending.pt"
    with nodes[0].client() as c:
        c.save(state(1), done, durability="persisted")  # an election, a persisted record
    assert own_etcd.proc is not None
    own_etcd.proc.send_signal(how)
    with nodes[0].client() as c:
        c.save(state(2), pending)  # committed; its persist cannot be claimed without etcd
    # The coordinator is seen failing with work in flight (and the lease keep-alive with it).
    wait_until(lambda: f"cannot claim {pending}" in nodes[0].log(), timeout=60)
    assert not pending.exists()

    for node in nodes:
        assert stop(node) == 0
        assert not Path(node.socket).exists()
        assert "ckptcache.daemon: stopped" in node.log()

    # Nothing was dropped: once etcd is back, the next start persists what was pending.
    if how == signal.SIGSTOP:
        own_etcd.proc.send_signal(signal.SIGCONT)
    else:
        own_etcd.start()  # same data directory and port
    nodes[0].start()  # same shm directory: recovers the unpersisted save
    with nodes[0].client() as c:
        c.wait(pending, timeout=120)
    assert_same(state(2), torch.load(pending, weights_only=True))
    assert_same(state(1), torch.load(done, weights_only=True))


def test_stop_with_etcd_killed(own_etcd, cluster_factory, tmp_path):
    # own_etcd first: it is torn down after the daemons.
    lose_coordinator_and_stop(own_etcd, cluster_factory, tmp_path, signal.SIGKILL)


def test_stop_with_etcd_hung(own_etcd, cluster_factory, tmp_path):
    lose_coordinator_and_stop(own_etcd, cluster_factory, tmp_path, signal.SIGSTOP)
