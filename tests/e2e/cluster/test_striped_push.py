"""Backup pushes and peer fetches split across parallel connections (``data_plane_streams``)
between real daemons: the receiving node holds the same bytes, and a sender killed with SIGKILL
mid-transfer leaves it nothing it would serve that is not a whole, verified save."""

from __future__ import annotations

import threading
import time

import torch

from ckptcache.errors import CkptCacheError
from tests.helpers import assert_same, wait_until

STREAMS = "data_plane_streams: 4\n"
N = 24 << 20  # float32 elements: 96 MiB, six 16 MiB stripes' worth, split four ways


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(N, generator=g), "b": torch.randn(1000, generator=g), "step": seed}


def _stripes_logged(node) -> bool:
    return "in 4 stripes" in node.log()


def test_striped_backup_push_delivers_the_same_bytes(cluster_factory, tmp_path):
    a, b = cluster_factory(2, "--log-level", "DEBUG", config=STREAMS)
    path = tmp_path / "iter_1" / "model.pt"
    with a.client() as ca:
        ca.save(state(1), path, durability="backup")
        assert ca.status(path).replicas == ("node1",)
    assert _stripes_logged(b)
    assert b.info(path).digests_valid
    a.kill()  # only the backup copy is left
    with b.client() as cb:
        assert_same(state(1), cb.load(path, verify=True))


def test_sender_killed_mid_striped_push(cluster_factory, tmp_path):
    a, b = cluster_factory(2, "--log-level", "DEBUG", config=STREAMS)
    path = tmp_path / "model.pt"
    with a.client() as ca:
        ca.save(state(1), path, durability="backup")  # a whole copy on b first
    before = b.log().count("in 4 stripes")
    with a.client() as ca:
        ca.save(state(2), path)  # durability local: the push runs in the background
    wait_until(lambda: b.log().count("in 4 stripes") > before, timeout=30, interval=0.002)
    a.kill()  # SIGKILL while the stripes are (most likely) still arriving
    time.sleep(0.5)
    # b serves a whole save, checked against its digests (the earlier one, or the new one if
    # its push completed before the kill), or says typed that the newest is out of reach;
    # never a mixture.
    with b.client() as cb:
        try:
            got = cb.load(path, verify=True)
        except CkptCacheError:
            got = None
        if got is not None:
            assert any(_same(got, state(s)) for s in (1, 2))
        assert b.log().count("committed " + str(path)) <= 2
    a.start()  # the origin comes back; its next push is striped again, whole
    wait_until(lambda: len(a.status().cluster_nodes) == 2, timeout=30)
    with a.client() as ca:
        ca.save(state(3), path, durability="backup")
    a.kill()
    with b.client() as cb:
        assert_same(state(3), cb.load(path, verify=True))


def _same(got: dict, want: dict) -> bool:
    try:
        assert_same(want, got)
    except (AssertionError, CkptCacheError):
        return False
    return True


def test_striped_peer_fetch_delivers_the_same_bytes(cluster_factory, tmp_path):
    a, _b, c = cluster_factory(3, "--log-level", "DEBUG", config=STREAMS)
    path = tmp_path / "fetched.pt"
    with a.client() as ca:
        ca.save(state(7), path, durability="backup")
    with c.client() as cc:
        assert_same(state(7), cc.load(path, verify=True))
        assert cc.status(path).last_load_tier == "peer"
    assert _stripes_logged(c)


def test_holder_killed_mid_striped_fetch(cluster_factory, tmp_path):
    """The node serving a striped fetch is killed with SIGKILL mid-transfer: the load gets the
    same bytes from the other holder, or fails typed; never a mixture."""
    a, b, c = cluster_factory(3, "--log-level", "DEBUG", config=STREAMS)
    path = tmp_path / "fetched.pt"
    with a.client() as ca:
        ca.save(state(8), path, durability="backup")  # held by a and b
    box: dict = {}

    def load() -> None:
        try:
            with c.client() as cc:
                box["got"] = cc.load(path, verify=True)
        except CkptCacheError as e:
            box["error"] = e

    loader = threading.Thread(target=load)
    loader.start()
    wait_until(lambda: _stripes_logged(c), timeout=30, interval=0.002)
    serving = a if "from node0" in c.log() else b
    serving.kill()
    loader.join(60)
    assert not loader.is_alive()
    if "got" in box:
        assert_same(state(8), box["got"])
    with c.client() as cc:  # the next load is whole either way
        assert_same(state(8), cc.load(path, verify=True))
