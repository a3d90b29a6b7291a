"""A delete that marks its path reads the cluster's newest stamp first, even where another
user's copy kept it from marking a moment before and then went; and a mark never moves
back. (The state is a stand-in: the race needs a copy to leave between two looks.)"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from ckptcache.server.memory.retention import Retention
from ckptcache.wire import messages as m

KEY = ("ns", "/p")


def _retention(held: list, deleted: dict) -> tuple[Retention, list[int]]:
    state = SimpleNamespace(
        lock=SimpleNamespace(held=contextlib.nullcontext),
        index=SimpleNamespace(generations=lambda key: list(held)),
        visible=lambda session, gen, _: gen.owner == session, deleted=deleted,
        superseded=SimpleNamespace(get=lambda key: None, forget=lambda key: None),
        update_gauges=lambda: None, retire_locked=held.remove,
        lookup_visible_locked=lambda *args: None,
    )  # fmt: skip
    retention = Retention.__new__(Retention)
    retention.state = state  # type: ignore[assignment]
    reads: list[int] = []
    retention.newest = lambda ns, path: reads.append(1) or 10_000
    return retention, reads


def test_a_copy_that_kept_a_delete_from_marking_and_went_is_no_gap():
    mine, theirs = (SimpleNamespace(owner=o, committed_ns=n) for o, n in (("a", 100), ("b", 200)))
    held = [mine, theirs]
    retention, reads = _retention(held, deleted={})
    looked = retention._marks

    def and_then_theirs_goes(session, key):
        answer = looked(session, key)
        held.remove(theirs)  # evicted, or deleted by its user, meanwhile
        return answer

    retention._marks = and_then_theirs_goes  # type: ignore[method-assign]
    assert retention.delete("a", m.DeleteRequest("ns", "/p")).dropped == 1
    assert (len(reads), retention.state.deleted[KEY]) == (1, 10_000)


def test_a_mark_never_moves_back():
    retention, _ = _retention([], deleted={KEY: 50_000})
    retention.delete("a", m.DeleteRequest("ns", "/p"))
    assert retention.state.deleted[KEY] == 50_000
