"""A save acknowledged ``persisted`` whose newest-save record the coordinator did not take
(the saver's ``advance`` failed while its other requests went through: etcd's leader cut off
from the other members, a gateway sending some of a node's requests to it). Two cluster cores
in process on one embedded coordinator; the saver's ``advance`` refuses."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ckptcache.server.cluster.coord import CoordinatorUnavailable
from ckptcache.wire import messages as m
from ckptcache.wire.states import PersistState
from tests.helpers import wait_until
from tests.server.conftest import NS, save_object


def _core(make_core, root: str, node_id: str):
    return make_core(persist_roots=(root,), listen="127.0.0.1:0", secret="s" * 32,
                     pool_bytes=0, node_id=node_id)  # fmt: skip


def _persisted(core, path: str, number: int) -> bool:
    gen = core.state.index.get((NS, path), number)
    return gen is not None and gen.persist_state == PersistState.PERSISTED


def _two_nodes_holding_the_first(make_core, tmp_path):
    """A saver and a loader on one coordinator, the path's first save persisted and loaded
    by the loader: (saver, loader, the saver's session, the loader's, the path)."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    saver, loader = _core(make_core, root, "saver"), _core(make_core, root, "loader")
    path = f"{root}/m.pt"
    session = saver.saves.open_session(1, os.getuid())
    first = save_object(saver, session, path, torch.full((64,), 1.0))
    wait_until(lambda: _persisted(saver, path, first.generation), what="generation 1 persisted")
    loads = loader.saves.open_session(1, os.getuid())
    loader.loads.open(loads, m.OpenRequest(NS, path, timeout=20))  # the loader holds it now
    return saver, loader, session, loads, path


def test_a_save_is_reported_persisted_only_once_every_node_knows_it(
    make_core, tmp_path, shared_coordinator, caplog
):
    """The coordinator refuses the saver's newest-save record for longer than the save waits
    for it and its persist's first tries: the object lands on storage, but the generation is
    not reported persisted (every node would still serve its older copy) until the record
    is in; from then on the loader serves the new save."""
    saver, loader, session, loads, path = _two_nodes_holding_the_first(make_core, tmp_path)
    coord = saver.cluster.membership.coord
    advance, refusing = coord.advance, threading.Event()
    refusing.set()

    def refuse(*args, **kwargs):
        if refusing.is_set():
            raise CoordinatorUnavailable("etcd advance failed: ConnectionTimeoutError")
        return advance(*args, **kwargs)

    coord.advance = refuse  # type: ignore[method-assign]
    second = save_object(saver, session, path, torch.full((64,), 2.0))
    wait_until(lambda: "waiting for the coordinator to record it" in caplog.text,
               what="the persist waiting for its record")  # fmt: skip
    assert float(torch.load(path)["w"][0]) == 2.0  # on storage ...
    assert not _persisted(saver, path, second.generation)  # ... and not reported persisted
    refusing.clear()
    wait_until(lambda: _persisted(saver, path, second.generation), what="generation 2 persisted")
    newest = saver.state.index.get((NS, path), second.generation)
    reply = loader.loads.open(loads, m.OpenRequest(NS, path, timeout=20))
    served = loader.state.index.get((NS, path), reply.generation)
    assert served is not None and served.committed_ns == newest.committed_ns


@pytest.mark.parametrize("durability", ["persisted", "local"])
def test_a_record_refused_for_a_moment_is_in_before_the_save_is_safe(
    make_core, tmp_path, shared_coordinator, durability
):
    """The saver's first two advances are refused (a request lost to one etcd member, a
    leader being elected): a save that asked for storage waits for its record, one that did
    not has it put by its persist at the latest; either way, once the save is persisted every
    node's load returns it."""
    from tests.server.conftest import written

    saver, loader, session, loads, path = _two_nodes_holding_the_first(make_core, tmp_path)
    coord = saver.cluster.membership.coord
    advance, refusals = coord.advance, [2]

    def flaky(*args, **kwargs):
        if refusals[0]:
            refusals[0] -= 1
            raise CoordinatorUnavailable("etcd advance failed: ConnectionTimeoutError")
        return advance(*args, **kwargs)

    coord.advance = flaky  # type: ignore[method-assign]
    reply, commit = written(saver, session, path, torch.full((64,), 2.0), durability)
    second = saver.saves.commit(session, commit).generation
    wait_until(lambda: _persisted(saver, path, second), what="generation 2 persisted")
    newest = saver.state.index.get((NS, path), second)
    reply = loader.loads.open(loads, m.OpenRequest(NS, path, timeout=20))
    served = loader.state.index.get((NS, path), reply.generation)
    assert served is not None and served.committed_ns == newest.committed_ns
