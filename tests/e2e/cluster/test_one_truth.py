"""One truth across nodes: successive saves of one path from different nodes.

A job whose rank 0 comes back on another node after a failure saves ``last.ckpt`` (or any
fixed name) again there. That save is the newest, whatever the new node held before: storage
gets it, and every node's next load returns it, never the copy a node kept from an earlier
generation.
"""

from __future__ import annotations

import io
import os
import threading

import pytest
import torch

from ckptcache.errors import CheckpointNotFound
from tests.e2e.cluster.test_cluster import _has, state
from tests.helpers import assert_same, read_only_dir, wait_until


def _save(node, obj, path, **kwargs):
    with node.client() as c:
        c.save(obj, path, durability="persisted", **kwargs)
        st = c.status(path)
        assert st.persist_state == "persisted", st
        assert not st.conflict, st


def _load(node, path):
    with node.client() as c:
        return c.load(path)


def _stored(path, s3=None):
    if s3 is None:
        return torch.load(path, weights_only=True)
    bucket, key = path[len("s3://") :].split("/", 1)
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    return torch.load(io.BytesIO(body), weights_only=True)


def _generations_from_three_nodes(nodes, path, s3=None):
    a, b, c = nodes
    _save(a, state(1), path)
    assert_same(state(1), _load(b, path))
    assert_same(state(1), _load(c, path))
    _save(a, state(2), path)
    assert_same(state(2), _stored(path, s3))
    for node in nodes:  # b and c held generation 1 in memory: it is not the newest now
        assert_same(state(2), _load(node, path))
    _save(c, state(3), path)  # a node that held an older copy saves the newest
    assert_same(state(3), _stored(path, s3))
    for node in nodes:
        assert_same(state(3), _load(node, path))


def test_file_path_saved_from_three_nodes(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    nodes = cluster_factory(3, "--persist-root", str(root))
    path = root / "run" / "last.pt"
    _generations_from_three_nodes(nodes, str(path))
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt"]  # no .conflict-*


def test_s3_path_saved_from_three_nodes(cluster_factory, s3_server, s3_bucket):
    nodes = cluster_factory(3, "--persist-root", f"s3://{s3_bucket}/run",
                            "--s3-endpoint-url", s3_server.endpoint)  # fmt: skip
    path = f"s3://{s3_bucket}/run/last.pt"
    s3 = s3_server.client()
    _generations_from_three_nodes(nodes, path, s3)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert keys == ["run/last.pt"]


@pytest.mark.parametrize("durability", ["local", "backup"])
def test_a_node_never_serves_its_copy_after_another_node_saved(cluster_factory, tmp_path,
                                                              durability):  # fmt: skip
    """Not yet persisted: the newer save is in the saver's memory (and its backup's) only."""
    root = tmp_path / "ckpt"
    a, b, c = cluster_factory(3, "--persist-root", str(root))
    path = root / "run" / "last.pt"
    _save(a, state(1), path)
    assert_same(state(1), _load(c, path))
    with b.client() as cb:
        cb.save(state(2), path, durability=durability)
    for node in (a, b, c):
        assert_same(state(2), _load(node, path))


def test_a_representative_killed_mid_persist_and_restarted_saves_again(cluster_factory, tmp_path):
    """The standby persists the group's content; the restarted representative finds its own
    generation on storage (the same save, stamped the same to the ns on both nodes: a stamp
    that came through a float was a few ns off and read as another writer's conflict, which
    held the node's budget) and its next save fits."""
    root = tmp_path / "ckpt"
    target = root / "run"
    target.mkdir(parents=True)
    nodes = cluster_factory(2, "--persist-root", str(root), "--memory-limit", "256MiB")
    path = target / "model.pt"
    big = state(1, n=40 << 20 >> 2)  # 40 MiB: two of them and a backup copy fill the budget
    with read_only_dir(target):  # the persist fails and retries: the representative is known
        with nodes[0].client() as c:
            c.save(big, path, durability="backup")
        wait_until(lambda: sorted(d.info(path).persist_state for d in nodes)
                   == ["persisting", "standby"], timeout=60)  # fmt: skip
        rep = next(d for d in nodes if d.info(path).persist_state == "persisting")
        rep.kill()
    standby = next(d for d in nodes if d is not rep)
    wait_until(lambda: standby.info(path).persist_state == "persisted", timeout=60)
    rep.start()
    wait_until(lambda: rep.info(path).persist_state == "persisted", timeout=60)
    assert "another ckptcache writer" not in rep.log()
    with rep.client() as c:
        for step in (2, 3, 4):
            c.save(state(step, n=40 << 20 >> 2), path, durability="persisted")
            assert not c.status(path).conflict
    assert_same(state(4, n=40 << 20 >> 2), torch.load(path, weights_only=True))


def test_a_later_save_replaces_an_earlier_one_persisted_after_it_began(cluster_factory,
                                                                      tmp_path):  # fmt: skip
    """Node a saves, node b saves the path after it; both persists are held up, and a's lands
    first. b's save followed a's: storage gets b's, never a conflict (nor a's kept)."""
    root = tmp_path / "ckpt"
    target = root / "run"
    target.mkdir(parents=True)
    a, b = cluster_factory(2, "--persist-root", str(root), "--backup", "none")
    path = target / "last.pt"
    with read_only_dir(target):  # every persist fails and retries until the directory opens
        with a.client() as ca:
            ca.save(state(1), path)
        wait_until(lambda: a.info(path).persist_error)  # a holds the writer role, failing
        with b.client() as cb:
            cb.save(state(2), path)
        # b waits for it. (Both at one poll raced: a's error is cleared while it retries.)
        wait_until(lambda: b.info(path).persist_state in ("queued", "persisting"))
    wait_until(lambda: b.info(path).persist_state == "persisted", timeout=60)
    assert not b.info(path).conflict
    assert_same(state(2), torch.load(path, weights_only=True))
    for node in (a, b):
        assert_same(state(2), _load(node, path))
    wait_until(lambda: a.info(path).generation != 1 or a.info(path).persist_state
               in ("superseded", "persisted"), timeout=60)  # fmt: skip
    assert sorted(p.name for p in target.iterdir()) == ["last.pt"]


def test_a_node_holding_an_older_copy_never_keeps_the_newest_from_storage(cluster_factory,
                                                                         tmp_path):  # fmt: skip
    """The newest save is only on storage (its saver is gone, no backup), and a live peer
    still holds an older copy: a third node reads storage. Its group read waited on that peer
    as if it were about to serve the path, which the newest-only plan never asks it to, until
    the load's deadline."""
    root = tmp_path / "ckpt"
    a, b, c = cluster_factory(3, "--persist-root", str(root), "--backup", "none")
    path = root / "run" / "last.pt"
    _save(a, state(1), path)
    assert_same(state(1), _load(b, path))  # b holds generation 1 from here on
    _save(a, state(2), path)
    a.kill()
    assert_same(state(2), _load(c, path))
    assert_same(state(2), _load(b, path))


def _skewed(daemon_factory, like, node_id: str, seconds: float):
    """A node of ``like``'s cluster whose wall clock runs ``seconds`` ahead."""
    args = list(like.args)
    for flag, value in (("--node-id", node_id), ("--host", f"host{node_id}")):
        args[args.index(flag) + 1] = value
    d = daemon_factory(*args, env={"CKPTCACHE_TEST_CLOCK_SKEW": str(seconds)}, start=False)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                          "skewed_clock.py")  # fmt: skip
    d.wrapper = ["/bin/sh", "-c", f'py="$1"; shift; exec "$py" {script} "$@"', "skewed"]
    return d.start()


@pytest.mark.parametrize("skew", [0.5, 3600.0])
def test_a_save_after_one_from_a_node_whose_clock_runs_ahead_is_the_newest(
    cluster_factory, daemon_factory, tmp_path, skew
):
    """Node ``ahead`` saves a path (its backup copy to node0 still on the way), then node0,
    whose clock is behind, saves it again. node0 stamps its save one nanosecond after the
    other (the newest it has seen): the late copy must be refused as older, and storage and
    every load end with node0's save, whatever the clocks say. (Float seconds cannot tell
    the two stamps apart: the copy was taken for the newer, and node0's save was lost while
    reported persisted.)"""
    root = tmp_path / "ckpt"
    (node0,) = cluster_factory(1, "--persist-root", str(root))
    ahead = _skewed(daemon_factory, node0, "ahead", skew)
    wait_until(lambda: len(node0.status().cluster_nodes) == 2, what="both nodes")
    wait_until(lambda: len(ahead.status().cluster_nodes) == 2, what="both nodes, seen ahead")
    for i in range(4):
        path = str(root / "run" / f"p{i}.pt")
        first, last = state(10 * i + 1, n=2 << 20), state(10 * i + 2)
        with ahead.client() as c:
            c.save(first, path)
        with node0.client() as c:
            c.save(last, path)
            c.wait(path, timeout=120)
        for node in (node0, ahead):
            with node.client() as c:
                c.wait(path, timeout=120)
                assert_same(last, c.load(path))
        assert_same(last, torch.load(path, weights_only=True))


def test_a_delete_is_not_undone_by_a_copy_from_a_node_whose_clock_runs_ahead(
    cluster_factory, daemon_factory, tmp_path
):
    """Node ``ahead`` (an hour ahead) saves a path; the node that holds nothing of it deletes
    it, then ``ahead`` re-replicates its save there (its first backup node killed): the copy
    is of a save made before the delete and is refused. (With the delete marked by this
    node's clock, the copy's stamp an hour ahead looked newer: the delete was undone.)"""
    root = tmp_path / "ckpt"
    nodes = cluster_factory(2, "--persist-root", str(root))
    ahead = _skewed(daemon_factory, nodes[0], "ahead", 3600.0)
    for d in (*nodes, ahead):
        wait_until(lambda d=d: len(d.status().cluster_nodes) == 3, what="three nodes")
    path = str(root / "m.pt")
    with ahead.client() as c:
        c.save(state(6), path, durability="persisted")
    backup = wait_until(lambda: next((d for d in nodes if _has(d, path)), None))
    (other,) = [d for d in nodes if d is not backup]
    with other.client() as c, pytest.raises(CheckpointNotFound):
        c.delete(path)  # holds nothing yet: nothing dropped, and nothing older may come
    backup.kill()  # ahead re-replicates its save to the node told to delete the path
    refused = lambda: "deleted on node" in ahead.log()  # noqa: E731
    wait_until(lambda: refused() or _has(other, path), timeout=60, what="the copy's fate")
    assert refused() and not _has(other, path)


def test_a_node_loads_while_another_saves_the_path_back_to_back(cluster_factory, tmp_path):
    """A save's newest-save record is put at its commit, and its holding is announced a
    moment later, behind the backup push of the save before: a load meanwhile finds no
    holder of the newest save. It asks the node that made it, and returns that save or a
    newer one, never an error and never an older one."""
    root = tmp_path / "ckpt"
    a, _, c = cluster_factory(3, "--persist-root", str(root))
    path = str(root / "run" / "last.pt")
    done = threading.Event()
    saved = [0]  # the newest step whose save returned

    def saving() -> None:
        with a.client() as trainer:
            step = 0
            while not done.is_set():
                step += 1
                trainer.save(state(step, n=1 << 18), path)
                saved[0] = step

    thread = threading.Thread(target=saving, daemon=True)
    thread.start()
    try:
        wait_until(lambda: saved[0] >= 1)
        with c.client() as reader:
            for _ in range(20):
                floor = saved[0]
                got = reader.load(path)
                assert got["step"] >= floor
                assert_same(state(got["step"], n=1 << 18), got)
    finally:
        done.set()
        thread.join(timeout=60)
