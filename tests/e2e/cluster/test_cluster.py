"""Several daemons on one etcd: backup copies, node loss, elections and takeover."""

from __future__ import annotations

import socket

import pytest
import torch

from ckptcache.errors import ReplicationError
from ckptcache.server.cluster.dataplane import DataPlaneClient, PeerRefused
from tests.helpers import assert_same, read_only_dir, wait_until


def state(seed=0, n=1 << 16):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


def holders(nodes, path):
    return [d.status().node_id for d in nodes if _has(d, path)]


def _has(d, path):
    with d.client() as c:
        return any(o.path == str(path) for o in c.list())


def test_backup_copy_arrives_and_survives_node_loss(cluster_factory, tmp_path):
    a, b, c = cluster_factory(3)
    path = tmp_path / "iter_1" / "model.pt"
    with a.client() as ca:
        ca.save(state(1), path, durability="backup")  # returns once the backup exists
        assert ca.status(path).replicas == ("node1",)
    info = b.info(path)
    assert info.origin == "node0" and info.digests_valid
    assert not _has(c, path)
    a.kill()  # node loss
    with b.client() as cb:
        assert_same(state(1), cb.load(path, verify=True))


def test_durability_backup_without_peers_is_an_error(daemon, tmp_path):
    with daemon.client() as c, pytest.raises(ReplicationError, match="--backup"):
        c.save(state(), tmp_path / "x.pt", durability="backup")


def test_re_replication_after_backup_loss(cluster_factory, tmp_path):
    a, b, c = cluster_factory(3)
    path = tmp_path / "m.pt"
    with a.client() as ca:
        ca.save(state(2), path, durability="backup")
    assert a.info(path).replicas == ("node1",)
    b.kill()
    wait_until(lambda: a.info(path).replicas == ("node2",), timeout=30)
    with c.client() as cc:
        assert_same(state(2), cc.load(path))
    assert "re-replicating" in a.log()


def test_group_persists_once_and_standby_takes_over(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    target_dir = root / "iter_5" / "mp_rank_00"
    target_dir.mkdir(parents=True)
    nodes = cluster_factory(3, "--persist-root", str(root), "--backup", "none")
    path = target_dir / "model_optim_rng.pt"
    with read_only_dir(target_dir):
        for d in nodes:  # three data-parallel replicas save the same shard
            with d.client() as c:
                c.save(state(5), path)
        wait_until(lambda: sorted(d.info(path).persist_state for d in nodes)
                   == ["persisting", "standby", "standby"])  # fmt: skip
        rep = next(d for d in nodes if d.info(path).persist_state == "persisting")
        rep.kill()  # the representative dies mid-persist
    survivors = [d for d in nodes if d is not rep]
    wait_until(
        lambda: all(d.info(path).persist_state == "persisted" for d in survivors), timeout=60
    )
    assert_same(state(5), torch.load(path))
    writers = [d for d in survivors if d.info(path).persist_seconds > 0]
    assert len(writers) == 1  # exactly one write by the survivors (the others: no time spent)
    assert "taking over" in "".join(d.log() for d in survivors)
    assert [p.name for p in target_dir.iterdir()] == ["model_optim_rng.pt"]


def test_exactly_one_persist_per_group(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    nodes = cluster_factory(3, "--persist-root", str(root), "--backup", "none")
    path = root / "iter_7" / "model.pt"
    for d in nodes:
        with d.client() as c:
            c.save(state(7), path)
    wait_until(lambda: all(d.info(path).persist_state == "persisted" for d in nodes), timeout=60)
    writes = sum(d.info(path).persist_seconds > 0 for d in nodes)
    assert writes == 1
    assert_same(state(7), torch.load(path))


def test_digest_disagreement_keeps_every_content(cluster_factory, tmp_path):
    """Two nodes save different contents of one path at the same time (neither had seen the
    other's save when its own began): both are kept and both are reported."""
    root = tmp_path / "ckpt"
    a, b = cluster_factory(2, "--persist-root", str(root), "--backup", "none")
    path = root / "model.pt"
    with a.client() as ca, b.client() as cb:
        racing_saves(ca, state(1), cb, state(2), path)  # a replica diverged
        wait_until(lambda: {ca.status(path).persist_state, cb.status(path).persist_state}
                   == {"persisted"}, timeout=60)  # fmt: skip
        conflicts = [ca.status(path).conflict, cb.status(path).conflict]
    assert all(conflicts), conflicts
    files = sorted(p.name for p in root.iterdir())
    assert files[0] == "model.pt" and files[1].startswith("model.pt.conflict-") and len(files) == 2
    assert torch.load(root / "model.pt")["step"] == 1  # the newer of the two: saved last
    contents = {torch.load(root / f)["step"] for f in files}
    assert contents == {1, 2}
    assert "digest disagreement" in a.log() + b.log()


def racing_saves(first, obj_first, second, obj_second, path):
    """``first`` begins a save (its reservation), ``second`` saves meanwhile, then ``first``
    copies and commits: the two saves overlap, and ``first``'s is the newer."""
    from ckptcache.client._saves import _Job

    saves = first._saves
    flat, plan = saves.plan(obj_first, str(path))
    job = _Job(obj_first, flat, plan, str(path), "local")
    reply = saves._reserve(job)
    second.save(obj_second, path)
    assert saves._copy_and_commit(job, reply)


def test_unauthenticated_peer_is_refused(cluster_factory):
    (a,) = cluster_factory(1)
    addr = next(line.split("data plane ")[1].rstrip(")") for line in a.log().splitlines()
                if "data plane" in line)  # fmt: skip
    with pytest.raises(PeerRefused):
        DataPlaneClient(addr, b"wrong secret")
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:  # garbage instead of a handshake
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
        s.settimeout(5)
        try:
            assert s.recv(100) == b""  # closed without a word
        except ConnectionResetError:
            pass  # closed with our garbage unread: also a refusal
    wait_until(lambda: a.log().count("refused data-plane peer") >= 2)


def _saw_etcd_outage(d) -> bool:
    log = d.log()
    return "etcd lease refresh failed" in log or "etcd unreachable" in log


def test_etcd_restart_is_survived(cluster_factory, etcd_server, tmp_path):
    a, b = cluster_factory(2)
    etcd_server.stop()
    wait_until(lambda: all(_saw_etcd_outage(d) for d in (a, b)), 30, "both nodes to see the outage")
    etcd_server.start()
    wait_until(lambda: len(a.status().cluster_nodes) == 2 and len(b.status().cluster_nodes) == 2)
    path = tmp_path / "after-restart.pt"
    with a.client() as ca:
        ca.save(state(9), path, durability="backup")
    assert_same(state(9), b.client().load(path))
