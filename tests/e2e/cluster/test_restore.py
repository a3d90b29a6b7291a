"""Tiered load on a cluster: local, peer, one storage read per group, corrupt and dead peers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import torch

from tests.e2e.cluster.test_cluster import state
from tests.e2e.local.test_corrupt import flip_bytes_of, wait_digested
from tests.helpers import assert_same, wait_until


def load_all(nodes, path):
    """Load ``path`` on every node at once; returns the objects (or exceptions)."""
    out: list = [None] * len(nodes)

    def run(i):
        try:
            with nodes[i].client() as c:
                out[i] = c.load(path)
        except Exception as e:  # reported by the assertions below
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_local_then_peer_then_storage(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    a, b, c = cluster_factory(3, "--persist-root", str(root), "--backup", "none")
    path = root / "iter_1" / "model.pt"
    with a.client() as ca:
        ca.save(state(1), path, durability="persisted")
        assert_same(state(1), ca.load(path))
        assert ca.status(path).last_load_tier == "local"
    with b.client() as cb:  # b never saved it: a's memory serves it
        assert_same(state(1), cb.load(path, verify=True))
        assert cb.status(path).last_load_tier == "peer"
    for d in (a, b):
        with d.client() as cl:
            cl.delete(path)
    with c.client() as cc:  # no memory copy anywhere: storage
        assert_same(state(1), cc.load(path))
        assert cc.status(path).last_load_tier == "storage"
        assert cc.status(path).persist_state == "persisted"  # not written back


def test_four_nodes_read_storage_once(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    path = root / "iter_2" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save(state(2, n=1 << 20), path)  # written by plain torch.save, no ckptcache
    nodes = cluster_factory(4, "--persist-root", str(root), "--backup", "none")
    results = load_all(nodes, path)
    for r in results:
        assert not isinstance(r, Exception), r
        assert_same(state(2, n=1 << 20), r)
    tiers = sorted(d.info(path).last_load_tier for d in nodes)
    assert tiers == ["peer", "peer", "peer", "storage"]
    reads = sum(d.log().count(f"read {path} from storage for the group") for d in nodes)
    assert reads == 1
    # A chain, not a star: no node relays the arriving object to more than one peer (the
    # others are refused as busy and chain behind the one it sends to).
    relays = [d.log().count(f"relaying {path} to a peer while it arrives") for d in nodes]
    assert max(relays) <= 1, relays
    # Each load was planned and executed once, at a bounded count of coordinator requests.
    pattern = rf"remote load of {re.escape(str(path))}: (\w+), (\d+) coordinator round trips"
    loads = [m for d in nodes for m in re.finditer(pattern, d.log())]
    assert sorted(m[1] for m in loads) == ["peer", "peer", "peer", "storage"]
    reader = next(int(m[2]) for m in loads if m[1] == "storage")
    assert 0 < reader <= 12  # plan, elect, in flight, holder, step down: not one per poll


def test_corrupt_peer_copy_falls_back_to_storage(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    a, b = cluster_factory(2, "--persist-root", str(root), "--backup", "none")
    path = root / "m.pt"
    with a.client() as ca:
        ca.save(state(3), path, durability="persisted")
        wait_digested(ca, str(path))
        flip_bytes_of(a, ca, str(path), 0)
    with b.client() as cb:
        assert_same(state(3), cb.load(path))
        assert cb.status(path).last_load_tier == "storage"
    wait_until(lambda: "corrupt copy" in a.log())  # the bad copy was reported and dropped
    with a.client() as ca:
        assert [o.path for o in ca.list()] == []


def test_reader_killed_mid_broadcast_does_not_stall_the_others(
    cluster_factory, tmp_path, s3_server, s3_bucket
):
    root = f"s3://{s3_bucket}/run"
    path = f"{root}/big.pt"
    nodes = cluster_factory(3, "--persist-root", root, "--backup", "none",
                            "--s3-endpoint-url", s3_server.endpoint)  # fmt: skip
    big = state(4, n=48 << 20)  # ~192 MiB: the S3 server takes a while to serve it
    with nodes[0].client() as c0:
        c0.save(big, path, durability="persisted")
        c0.delete(path)
    results: list = [None] * 3

    def run(i):
        try:
            with nodes[i].client() as c:
                results[i] = c.load(path, mmap=False)["step"]
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: any("reading" in d.log() and f"{path} from storage" in d.log()
                           for d in nodes), timeout=60, interval=0.01)  # fmt: skip
    reader = next(i for i, d in enumerate(nodes) if f"reading {path} from storage" in d.log())
    nodes[reader].kill()  # dies mid-read
    for t in threads:
        t.join(180)
    survivors = [results[i] for i in range(3) if i != reader]
    assert survivors == [4, 4], results


def test_prefetch_cli_reports_the_tier(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    a, b = cluster_factory(2, "--persist-root", str(root), "--backup", "none")
    path = str(root / "p.pt")
    with a.client() as ca:
        ca.save(state(5), path)
    env = {**os.environ, "CKPTCACHE_SOCKET": b.socket}
    out = subprocess.run([sys.executable, "-m", "ckptcache.cli", "prefetch", path, "--json"],
                         env=env, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {path: "peer"}
    assert b.info(path).generation == 1
