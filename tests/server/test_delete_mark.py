"""A delete that marks its path reads the cluster's newest stamp first (the look and the
mark are one locked step), one that does not mark reads nothing, and a mark never moves
back. (The state is a stand-in for the index and the lock.)"""

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


def test_a_delete_that_marks_reads_the_record_and_one_that_does_not_reads_nothing():
    mine, theirs = (SimpleNamespace(owner=o, committed_ns=n) for o, n in (("a", 100), ("b", 200)))
    held = [mine, theirs]
    retention, reads = _retention(held, deleted={})
    # Another user's copy is held: no mark, and no etcd read for one.
    assert retention.delete("a", m.DeleteRequest("ns", "/p")).dropped == 1
    assert (reads, retention.state.deleted) == ([], {})
    # Once it has gone, the delete marks the path with the cluster's newest stamp.
    held.remove(theirs)
    retention.delete("a", m.DeleteRequest("ns", "/p"))
    assert (len(reads), retention.state.deleted[KEY]) == (1, 10_000)


def test_a_mark_never_moves_back():
    retention, _ = _retention([], deleted={KEY: 50_000})
    retention.delete("a", m.DeleteRequest("ns", "/p"))
    assert retention.state.deleted[KEY] == 50_000
