"""The persist election on one node of a cluster (embedded coordinator, real data plane), in
process: saving a path again is never a digest disagreement, a persist record counts only
while storage holds that content, and a representative that stops without writing hands its
role back."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from ckptcache.server.cluster.membership import path_hash
from ckptcache.server.restore import fetching as fetching_module
from ckptcache.wire import messages as m
from ckptcache.wire import peer
from ckptcache.wire.states import ClaimRole, PersistState
from tests.helpers import wait_until
from tests.server.conftest import NS, save_object


def _cluster_core(make_core, root: str, **options):
    return make_core(persist_roots=(root,), listen="127.0.0.1:0", secret="s" * 32,
                     pool_bytes=0, **options)  # fmt: skip


@pytest.fixture
def node(make_core, tmp_path):
    """A cluster node with a persist root: (core, a session, the root)."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    core = _cluster_core(make_core, root)
    return core, core.saves.open_session(1, os.getuid()), root


def _persisted(core, path: str, number: int) -> bool:
    gen = core.state.index.get((NS, path), number)
    return gen is not None and gen.persist_state == PersistState.PERSISTED


def _stored(path: str) -> float:
    return float(torch.load(path)["w"][0])


def _save_persisted(core, session, path: str, value: float) -> None:
    saved = save_object(core, session, path, torch.full((64,), value))
    wait_until(lambda: _persisted(core, path, saved.generation), what="persisted")


def test_saving_a_path_again_is_not_a_disagreement(node):
    core, session, root = node
    path = f"{root}/m.pt"
    for value in (1.0, 2.0):  # well within the conflict window of 60 s
        _save_persisted(core, session, path, value)
    assert sorted(os.listdir(root)) == ["m.pt"]  # no .conflict- sidecar
    assert _stored(path) == 2.0
    assert core.state.index.newest((NS, path)).conflict == ""


def test_content_saved_again_after_another_is_written_again(node):
    core, session, root = node
    path = f"{root}/x.pt"
    for value in (1.0, 2.0, 1.0):  # X, Y, X: the record of X's first persist is stale
        _save_persisted(core, session, path, value)
        assert _stored(path) == value


def test_a_superseded_representative_hands_its_role_back(node):
    core, session, root = node
    path = f"{root}/r.pt"
    elected, go = threading.Event(), threading.Event()
    election = core.persister.election
    claim = election.claim

    def claim_then_stall(gen):
        role = claim(gen)
        if gen.number == 1:
            assert role[0] == ClaimRole.LEAD
            elected.set()
            go.wait(30)  # generation 2 commits while generation 1 holds the role
        return role

    election.claim = claim_then_stall
    save_object(core, session, path, torch.full((64,), 1.0))
    assert elected.wait(30)
    second = save_object(core, session, path, torch.full((64,), 2.0))
    go.set()
    wait_until(lambda: _persisted(core, path, second.generation), timeout=30,
               what="the newer generation persisted")  # fmt: skip
    assert _stored(path) == 2.0


def test_a_stale_holder_entry_does_not_stall_a_load(make_core, tmp_path, shared_coordinator):
    """A node still announced as holding a path it no longer holds (its copy retired, the
    withdrawal not yet through) answers "not here": after a few such answers the load stops
    asking it and reads storage, instead of asking it again until its deadline."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    loader = _cluster_core(make_core, root, node_id="loader")
    stale = _cluster_core(make_core, root, node_id="stale")
    path = f"{root}/f.pt"
    torch.save({"w": torch.full((64,), 9.0)}, path)
    ph = path_hash(NS, path)
    stale.cluster.membership.coord.announce(  # type: ignore[union-attr]
        f"holders/{ph}/{'0' * 16}/stale", {"node": "stale", "path": path, "generation": 1,
                                           "committed": time.time() + 3600},
    )  # fmt: skip
    session = loader.saves.open_session(1, os.getuid())
    reply = loader.loads.open(session, m.OpenRequest(NS, path, timeout=20))
    assert reply.tier == "storage"
    gen = loader.state.index.newest((NS, path))
    assert gen is not None and gen.origin == "storage"


def test_a_corruption_report_drops_only_the_generation_served(make_core, monkeypatch):
    """A peer found generation 1 corrupt while this node committed generation 2: only
    generation 1 goes (the newest save is another content); a report on a relayed copy
    (no generation) drops nothing here."""
    core = make_core(listen="127.0.0.1:0", secret="s" * 32, pool_bytes=0)
    session = core.saves.open_session(1, os.getuid())
    path = "/mem/c.pt"
    for value in (1.0, 2.0):
        save_object(core, session, path, torch.full((64,), value))
    monkeypatch.setattr(fetching_module, "send_msg", lambda conn, message: None)
    fetching = core.cluster.fetching  # type: ignore[union-attr]

    fetching.on_corrupt(None, peer.CorruptReport(NS, path, "relayed", generation=0))
    assert [g.number for g in core.state.index.generations((NS, path))] == [1, 2]
    fetching.on_corrupt(None, peer.CorruptReport(NS, path, "digest mismatch", generation=1))
    assert [g.number for g in core.state.index.generations((NS, path))] == [2]


def test_stepping_down_never_takes_another_nodes_role(make_core, tmp_path, shared_coordinator):
    """A node stepping down (its copy superseded, dropped, or a worker error, perhaps while
    it was only a standby) gives up the roles it holds, never those another node holds: a
    representative that lost its role would otherwise let a second writer start on the path
    while the first still writes."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    lead = _cluster_core(make_core, root, node_id="lead")
    standby = _cluster_core(make_core, root, node_id="standby")
    path = f"{root}/s.pt"
    ph = path_hash(NS, path)
    lead_coord = lead.cluster.membership.coord  # type: ignore[union-attr]
    assert lead_coord.elect(f"writer/{ph}", {"node": "lead", "digest": "d"})
    session = standby.saves.open_session(1, os.getuid())
    save_object(standby, session, path, torch.full((64,), 3.0))
    gen = standby.state.index.newest((NS, path))
    assert gen is not None
    wait_until(lambda: gen.persist_state == PersistState.PERSISTING and gen.digests is not None,
               what="the standby's claim blocked by the lead's writer role")  # fmt: skip
    standby.persister.election.step_down(gen)
    assert lead_coord.get(f"writer/{ph}") == {"node": "lead", "digest": "d"}
    lead_coord.release(f"writer/{ph}")  # the lead finishes: the standby's persist goes through
    wait_until(lambda: _persisted(standby, path, gen.number), what="persisted after the lead")
    assert _stored(path) == 3.0


def test_a_claim_that_fails_after_it_won_the_roles_leads_when_claimed_again(node):
    """A coordinator request fails after this node won the representative's and the writer's
    keys (a later step of the claim failed; or etcd created a key and its answer was lost):
    the claim a second later finds the keys its own and leads, instead of waiting as the
    standby of itself until its lease lapses. In the cluster lab (etcd's leader cut off from
    the other members, then healed) a ``durability="persisted"`` save waited forever."""
    from ckptcache.server.cluster.coord import CoordinatorUnavailable

    core, session, root = node
    path = f"{root}/k.pt"
    election = core.persister.election
    target = election._conflict_target
    calls = []

    def fail_once_after_the_election(gen, ph, digest):
        calls.append(gen.number)
        if len(calls) == 2:  # the claim's last request, both roles won
            raise CoordinatorUnavailable("etcd scan failed: Service Unavailable")
        return target(gen, ph, digest)

    election._conflict_target = fail_once_after_the_election
    _save_persisted(core, session, path, 5.0)
    assert len(calls) >= 3  # claimed again
    assert _stored(path) == 5.0
