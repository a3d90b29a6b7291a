"""Two generations of one path with the same bytes share a holder key: the older one leaving,
or announced late, never takes the newer one's holding away (an in-process cluster node on an
embedded coordinator, real saves, the withdrawal run where the race puts it)."""

from __future__ import annotations

import os

import torch

from ckptcache.format.manifest import object_digest
from ckptcache.server.cluster.coord import keys
from ckptcache.server.cluster.coord.records import HolderRecord
from ckptcache.server.cluster.membership import path_hash
from tests.server.conftest import NS, digested, save_object


def _node(make_core):
    return make_core(listen="127.0.0.1:0", secret="s" * 32, pool_bytes=0, node_id="n0",
                     backup="none", keep=1)  # fmt: skip


def _two_of_same_content(core, path):
    """Two saves of ``path`` with equal bytes; the first one has left the index."""
    session = core.saves.open_session(1, os.getuid())
    value = torch.arange(4096, dtype=torch.float32)
    first = core.state.index.newest((NS, path))
    save_object(core, session, path, value)
    old = core.state.index.newest((NS, path))
    digested(old)
    save_object(core, session, path, value)
    new = core.state.index.newest((NS, path))
    digested(new)
    assert first is None and old is not new and old.removed and not new.removed
    assert old.digests == new.digests
    return old, new


def _record(core, gen) -> HolderRecord | None:
    ph = path_hash(NS, gen.path)
    key = keys.holder_key(ph, object_digest(gen.digests), core.config.node_id)
    value = core.cluster.membership.coord.get(key)
    return None if value is None else HolderRecord.from_dict(value)


def test_the_older_one_leaving_keeps_the_newer_ones_holding(make_core, shared_coordinator):
    core = _node(make_core)
    membership = core.cluster.membership
    old, new = _two_of_same_content(core, "/tmp/holdings/a.pt")
    membership.announce(old)  # the older push's announcement, then the newer one's
    membership.announce(new)
    # The older one's withdrawal, queued when it left, runs only now (a loaded machine).
    membership.withdraw_held(old)
    held = _record(core, new)
    assert held is not None and held.committed_ns == new.committed_ns
    membership.withdraw_held(new)  # the newer one leaving does withdraw it
    assert _record(core, new) is None


def test_the_older_one_announced_late_keeps_the_newer_stamp(make_core, shared_coordinator):
    core = _node(make_core)
    membership = core.cluster.membership
    old, new = _two_of_same_content(core, "/tmp/holdings/b.pt")
    membership.announce(new)
    old.removed = False  # announced by a push that checked it current a moment before
    membership.announce(old)
    held = _record(core, new)
    assert held is not None and held.committed_ns == new.committed_ns > old.committed_ns
