"""A load that finds no holder of the cluster's newest save asks the node that made it
(``remote_load._maker``), but never a member without a data plane: such a node saves and
records its saves, and serves no copy; the load reads storage."""

from __future__ import annotations

import os

import torch

from ckptcache.wire import messages as m
from tests.helpers import wait_until
from tests.server.conftest import NS, written


def test_a_save_made_by_a_node_without_a_data_plane_loads_from_storage(
    make_core, tmp_path, shared_coordinator
):
    root = str(tmp_path / "store")
    os.makedirs(root)
    common = dict(persist_roots=(root,), secret="s" * 32, pool_bytes=0,
                  coordinator="etcd://127.0.0.1:1")  # fmt: skip
    saver = make_core(node_id="saver", **common)  # no --listen: no data plane
    reader = make_core(node_id="reader", listen="127.0.0.1:0", **common)
    wait_until(lambda: {n.node_id for n in reader.cluster.membership.live_nodes(max_age=0)}
               == {"saver", "reader"}, what="both live")  # fmt: skip
    path = f"{root}/m.pt"
    session = saver.saves.open_session(1, os.getuid())
    value = torch.arange(4096, dtype=torch.float32)
    _, commit = written(saver, session, path, value, durability="persisted")
    saver.saves.commit(session, commit)
    wait_until(lambda: (g := saver.state.index.newest((NS, path))) is not None and g.persisted,
               timeout=30, what="the save persisted")  # fmt: skip
    reply = reader.loads.open(reader.saves.open_session(1, os.getuid()),
                              m.OpenRequest(NS, path, timeout=20))  # fmt: skip
    assert reply.tier == "storage"
