"""A remote load is answered once its copy is committed here, before the bookkeeping that
tells the others about it (announce the holding, leave the in-flight key, step down from the
storage-read election), which keeps its order and always ends: two in-process cluster nodes on
one embedded coordinator, the copy read from real files, the coordinator's answers held back
or failed for real."""

from __future__ import annotations

import os
import threading

import torch

from ckptcache.format.manifest import object_digest
from ckptcache.server.cluster.coord import CoordinatorUnavailable, keys
from ckptcache.server.cluster.membership import path_hash
from ckptcache.wire import messages as m
from tests.helpers import wait_until
from tests.server.conftest import NS


def _two_nodes(make_core, tmp_path):
    """A reader and another live node (so the reader is not alone: it runs the election and
    announces itself in flight), and a stored file only storage holds."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    nodes = [make_core(persist_roots=(root,), listen="127.0.0.1:0", secret="s" * 32,
                       pool_bytes=0, node_id=name) for name in ("reader", "other")]  # fmt: skip
    path = f"{root}/m.pt"
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)
    return nodes[0], path


def _keys(coord, ph: str) -> set[str]:
    """This path's coordinator keys: holdings, copies in flight, the election."""
    found = set(coord.scan(keys.holders_prefix(ph)))
    if coord.get(keys.load_key(ph)) is not None:
        found.add("election")
    return {"election" if k == "election" else k.split("/")[-2] for k in found}


def test_the_load_is_answered_before_the_copy_is_announced(make_core, tmp_path, monkeypatch,
                                                           shared_coordinator):  # fmt: skip
    reader, path = _two_nodes(make_core, tmp_path)
    coord = reader.cluster.membership.coord
    ph = path_hash(NS, path)
    answered = threading.Event()
    order: list[str] = []
    announce = coord.announce

    def held_announce(key: str, value: dict) -> None:
        if key.startswith(keys.holders_prefix(ph)) and "/inflight/" not in key:
            answered.wait(30)  # without the change the load waits here: order says so
            order.append("announced")
        announce(key, value)

    monkeypatch.setattr(coord, "announce", held_announce)
    session = reader.saves.open_session(1, os.getuid())
    reply = reader.loads.open(session, m.OpenRequest(NS, path, timeout=60))
    order.append("answered")
    # Answered with the bookkeeping held: nothing of it has been done out of order (the
    # in-flight key and the election stay until the holding is announced).
    assert reply.tier == "storage"
    assert _keys(coord, ph) == {"inflight", "election"}
    answered.set()
    gen = reader.state.index.newest((NS, path))
    assert gen is not None and gen.origin == "storage" and gen.digests is not None
    holding = keys.holder_key(ph, object_digest(gen.digests), "reader")
    wait_until(lambda: _keys(coord, ph) == {holding.split("/")[-2]}, what="bookkeeping done")
    # (the replication worker announces every commit too, also held back until the answer)
    assert order[0] == "answered" and set(order[1:]) == {"announced"}
    assert torch.equal(torch.load(path)["w"], torch.arange(4096, dtype=torch.float32))


def test_a_failed_announcement_still_releases_the_flight_and_the_election(
    make_core, tmp_path, monkeypatch, shared_coordinator
):
    """The coordinator refuses the announcement: the load still returns the committed copy,
    and the keys others wait on are released (a deposed reader never makes them wait)."""
    reader, path = _two_nodes(make_core, tmp_path)
    coord = reader.cluster.membership.coord
    ph = path_hash(NS, path)
    announce = coord.announce

    def refused(key: str, value: dict) -> None:
        if "/inflight/" not in key:
            raise CoordinatorUnavailable("etcd went away")
        announce(key, value)

    monkeypatch.setattr(coord, "announce", refused)
    session = reader.saves.open_session(1, os.getuid())
    reply = reader.loads.open(session, m.OpenRequest(NS, path, timeout=60))
    assert reply.tier == "storage"
    wait_until(lambda: _keys(coord, ph) == set(), what="the flight and the election released")
