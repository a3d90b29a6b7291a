"""Integrity and coordinator faults on several daemons: a corrupt copy is replaced from a peer,
a damaged file is never served, and an etcd outage neither fails a finished persist nor
blocks loads from storage."""

from __future__ import annotations

import pytest
import torch

from ckptcache.errors import (
    CheckpointNotFound,
    CoordinatorUnavailable,
    CorruptCheckpoint,
    ReplicationError,
)
from tests.e2e.local.test_corrupt import flip_bytes_of
from tests.helpers import EtcdServer, assert_same, read_only_dir, wait_until


def state(seed=0, n=1 << 16):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(64, generator=g), "step": seed}


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd this test may stop and restart (same data directory and port)."""
    (tmp_path / "etcd").mkdir()
    server = EtcdServer(tmp_path / "etcd" / "data").start()
    yield server
    server.stop()


def blocked_group(cluster_factory, tmp_path, obj, **kw):
    """Two nodes holding ``obj`` at ``<root>/iter_1/m.pt`` while its directory refuses writes;
    returns (nodes, path, target_dir) with the representative known to be failing."""
    root = tmp_path / "ckpt"
    target_dir = root / "iter_1"
    target_dir.mkdir(parents=True)
    nodes = cluster_factory(2, "--persist-root", str(root), **kw)
    return nodes, root, target_dir, target_dir / "m.pt"


def lead_and_standby(nodes, path):
    """The representative (its attempts fail) and the standby of ``path``'s group."""
    wait_until(lambda: any(d.info(path).persist_error for d in nodes), timeout=60)
    lead = next(d for d in nodes if d.info(path).persist_error)
    other = next(d for d in nodes if d is not lead)
    return lead, other


def test_corrupt_copy_is_not_persisted_and_a_peer_copy_replaces_it(cluster_factory, tmp_path):
    nodes, _, target_dir, path = blocked_group(cluster_factory, tmp_path, state(1))
    with read_only_dir(target_dir):
        with nodes[0].client() as c:
            c.save(state(1), path, durability="backup")
        wait_until(lambda: all(d.info(path).digests_valid for d in nodes))
        lead, _ = lead_and_standby(nodes, path)
        with lead.client() as c:
            flip_bytes_of(lead, c, path, tensor_index=0)
    # The representative finds the damage while copying, steps down and fetches a good copy;
    # the group persists the good bytes.
    wait_until(lambda: path.exists(), timeout=120)
    assert_same(state(1), torch.load(path, weights_only=True))
    wait_until(lambda: "replaced the corrupt copy" in lead.log(), timeout=60)
    assert "not persisting" in lead.log()
    with lead.client() as c:
        assert_same(state(1), c.load(path, verify=True))
        c.wait(path, timeout=120)


def test_damaged_file_is_not_served_by_the_group(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    nodes = cluster_factory(2, "--persist-root", str(root))
    path = root / "m.pt"
    with nodes[0].client() as c:
        c.save(state(2), path, durability="persisted")
    good = path.read_bytes()
    # "persisted" does not wait for the backup copy: let it land, then clear both memories.
    wait_until(lambda: all(d.status().objects for d in nodes))
    for d in nodes:
        with d.client() as c:
            c.delete(path)
    wait_until(lambda: all(not d.status().objects for d in nodes))
    flipped = bytearray(good)
    flipped[good.index(state(2)["w"][:4].numpy().tobytes()) + 2] ^= 0x10
    path.write_bytes(bytes(flipped))
    with nodes[1].client() as c:
        with pytest.raises(CorruptCheckpoint, match=r"m\.pt.*does not match"):
            c.load(path)  # the daemon reads and checks it for the group: not served
        path.write_bytes(good[: len(good) - 1000])
        with pytest.raises(CorruptCheckpoint, match=r"m\.pt.*truncated"):
            c.load(path)
        path.write_bytes(good)
        assert_same(state(2), c.load(path, verify=True))


def test_etcd_lost_between_write_and_record(cluster_factory, tmp_path, own_etcd):
    nodes, _, target_dir, path = blocked_group(cluster_factory, tmp_path, state(3), etcd=own_etcd)
    with read_only_dir(target_dir):
        with nodes[0].client() as c:
            c.save(state(3), path, durability="backup")
        lead, other = lead_and_standby(nodes, path)
        own_etcd.stop()  # the representative has claimed; now etcd goes away
    # The file is complete, but not reported persisted while no node can learn that it is
    # the path's newest save: a node reading the record first once etcd is back would
    # serve its older copy of a save reported persisted.
    wait_until(lambda: "waiting for the coordinator to record it" in lead.log(), timeout=120)
    assert_same(state(3), torch.load(path, weights_only=True))
    assert lead.info(path).persist_state == "persisting"
    own_etcd.start()  # same data directory and port
    with lead.client() as c:
        c.wait(path, timeout=120)
        assert c.status(path).persist_state == "persisted"
    wait_until(lambda: other.info(path).persist_state == "persisted", timeout=60)
    assert "internal error" not in lead.log()
    from etcd3gw.client import Etcd3Client

    etcd = Etcd3Client(host="127.0.0.1", port=own_etcd.client_port)

    def keys() -> list[str]:
        return [m["key"].decode() if isinstance(m["key"], bytes) else m["key"]
                for _, m in etcd.get_all()]  # fmt: skip

    wait_until(lambda: not [k for k in keys() if "/reps/" in k or "/writer/" in k],
               what="the persist's roles given up")  # fmt: skip
    assert [k for k in keys() if "/persisted/" in k]


def test_etcd_outage_loads_say_so_unless_stale_bytes_are_accepted(own_etcd, cluster_factory,
                                                                    tmp_path):  # fmt: skip
    """While etcd is down, no node can know whether another saved the path since: a load
    raises CoordinatorUnavailable, from memory or storage alike, and returns the possibly
    older bytes only to a client that opted in."""
    # own_etcd first: it is torn down after the daemons, which leave it cleanly.
    root = tmp_path / "ckpt"
    nodes = cluster_factory(2, "--persist-root", str(root), etcd=own_etcd)
    path, held = root / "m.pt", root / "held.pt"
    with nodes[0].client() as c, nodes[0].client(allow_stale=True) as stale:
        c.save(state(4), path, durability="persisted")
        c.save(state(6), held, durability="persisted")
        c.delete(path)
        own_etcd.stop()
        for p in (path, held):  # in storage only / in this node's memory
            with pytest.raises(CoordinatorUnavailable, match="coordinator is unreachable"):
                c.load(p)
        assert_same(state(4), stale.load(path, verify=True))  # storage, as opted in
        assert_same(state(6), stale.load(held, verify=True))  # this node's memory
        wait_until(lambda: nodes[0].status().cluster_nodes == ())  # membership view expired
        with pytest.raises(ReplicationError, match="coordinator is unreachable"):
            c.save(state(5), root / "other.pt", durability="backup")
    own_etcd.start()
    with nodes[0].client() as c:  # back: the answer is known again
        wait_until(lambda: _loads(c, held), timeout=30)
        assert_same(state(6), c.load(held))


def _loads(c, path) -> bool:
    try:
        c.load(path)
    except CoordinatorUnavailable:
        return False
    return True


def _holds(d, path) -> bool:
    with d.client() as c:
        return any(o.path == str(path) for o in c.list())


def test_delete_is_not_undone_by_a_backup_copy_in_transit(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    a, b, c = cluster_factory(3, "--persist-root", str(root))
    path = root / "m.pt"
    with a.client() as ca:
        ca.save(state(6), path, durability="persisted")
    wait_until(lambda: _holds(b, path))  # the backup copy (node1 follows node0)
    with c.client() as cc, pytest.raises(CheckpointNotFound):
        cc.delete(path)  # holds nothing yet: nothing dropped, and nothing older may come
    with b.client() as cb:
        assert cb.delete(path) == 1  # the backup copy goes
        assert cb.status(path).stages == ("storage",)
    b.kill()  # node0 re-replicates its copy to node2, which was told to delete the path
    wait_until(lambda: "refused" in a.log() and "deleted on node" in a.log(), timeout=60)
    assert not _holds(c, path)
    with a.client() as ca:
        assert ca.delete(path) == 1
    for d in (a, c):
        with d.client() as cl:
            assert cl.status(path).stages == ("storage",) and cl.exists(path)
            assert_same(state(6), cl.load(path))  # from storage, the only copy left
