"""Hollow generations served to peers, on real daemons over a real etcd: a backup node's copies
of older checkpoints share their frozen base with its newest copy, and after the node that saved
them is lost, each comes back bitwise from those copies: with the backup node restarted by a
kill -9 in between, with the copy holding the base deleted, and never with bytes a changed
backing page gave it."""

from __future__ import annotations

import copy
import shutil

import torch

from tests.e2e.local.test_shared_pages import base_bytes, shared, zero_base_bytes
from tests.e2e.local.test_skip_unchanged import equal, lora, step
from tests.helpers import metric, wait_until


def _nodes(cluster_factory, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    a, b = cluster_factory(2, "--persist-root", str(root), "--metrics-port", "0")
    return root, a, b


def _steps(node, root, count: int) -> tuple[dict, dict[str, dict]]:
    """Three step checkpoints saved on ``node`` with a backup copy, persisted; the live state
    and what each held, by path."""
    state, saved = lora(), {}
    with node.client() as c:
        for i in range(count):
            step(state)
            path = str(root / "job" / f"iter_{i:07d}" / "model.pt")
            c.save(state, path, durability="backup")
            c.wait(path, timeout=60)
            saved[path] = copy.deepcopy(state)
    return state, saved


def _lose(node) -> None:
    """The node is lost and replaced: killed, and back with empty memory."""
    node.kill()
    shutil.rmtree(node.segments_dir, ignore_errors=True)
    node.start()


def _load_from_peer(node, path: str) -> dict:
    with node.client() as c:
        got = c.load(path, mmap=False, verify=True)
        assert c.status(path).last_load_tier == "peer"
    return got


def _hollow_backup(cluster_factory, tmp_path, count: int = 3):
    root, a, b = _nodes(cluster_factory, tmp_path)
    state, saved = _steps(a, root, count)
    # The backup node's older copies read their base from its newest copy's memory.
    wait_until(lambda: shared(b) >= (count - 1) * base_bytes(state), 60, "the backup's base shared")
    return a, b, state, saved


def test_a_lost_node_gets_its_checkpoints_back_from_hollow_backup_copies(cluster_factory, tmp_path):
    a, b, _, saved = _hollow_backup(cluster_factory, tmp_path)
    _lose(a)
    for path, held in saved.items():  # the oldest first: made whole on b from its newest copy
        assert equal(_load_from_peer(a, path), held)
    assert (metric(b, 'ckptcache_corrupt_total{tier="local"}') or 0) == 0


def test_a_push_to_the_backup_node_leaves_its_older_copies_shared(cluster_factory, tmp_path):
    """The next step's push, less what the backup node holds, reads only the copy its base
    is taken from (the newest, which is whole): the older copies stay hollow."""
    a, b, state, _ = _hollow_backup(cluster_factory, tmp_path)
    before = shared(b)
    step(state)
    path = str(tmp_path / "store" / "job" / "next" / "model.pt")
    with a.client() as c:
        c.save(state, path, durability="backup")
    assert metric(a, "ckptcache_push_bytes_held_total") >= base_bytes(state)  # base not sent
    assert shared(b) >= before
    _lose(a)
    assert equal(_load_from_peer(a, path), state)


def test_hollow_backup_copies_are_served_after_the_backup_node_restarts(cluster_factory, tmp_path):
    """A kill -9 of the backup node once its copies are hollow: it rebuilds their sharing from
    its records and serves each bitwise to the replaced node."""
    a, b, state, saved = _hollow_backup(cluster_factory, tmp_path)
    b.restart()
    # Rebuilt before it serves; and a restart re-sends nothing already on storage (which
    # would read those copies whole again).
    assert wait_until(lambda: shared(b), 30, "the backup's metrics") >= 2 * base_bytes(state)
    _lose(a)
    for path, held in saved.items():
        assert equal(_load_from_peer(a, path), held)


def test_a_hollow_backup_copy_outlives_the_copy_holding_its_base(cluster_factory, tmp_path):
    """The newest checkpoint's copy deleted on the backup node: it keeps the memory the older
    copies read their base from, and serves them bitwise."""
    a, b, _, saved = _hollow_backup(cluster_factory, tmp_path)
    *older, newest = saved
    with b.client() as cb:
        assert cb.delete(newest) == 1
    _lose(a)
    for path in older:
        assert equal(_load_from_peer(a, path), saved[path])


def test_a_changed_backing_page_on_the_backup_node_is_never_served(cluster_factory, tmp_path):
    """A write into the backup node's newest copy, inside the base its older copies share:
    the older copies fail their check as they are made whole, are dropped there, and the
    replaced node reads their bytes from storage, never the changed ones."""
    a, b, state, saved = _hollow_backup(cluster_factory, tmp_path)
    *older, newest = saved
    with b.client() as cb:
        zero_base_bytes(b, cb, newest, state, at=100_000)
    _lose(a)
    with a.client() as c:
        for path in older:
            assert equal(c.load(path, mmap=False, verify=True), saved[path])
            assert c.status(path).last_load_tier == "storage"
        assert equal(c.load(newest, mmap=False, verify=True), saved[newest])
    assert metric(b, 'ckptcache_corrupt_total{tier="local"}') >= len(older)
    for path in saved:
        assert equal(torch.load(path, weights_only=True), saved[path])
