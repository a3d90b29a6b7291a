"""The cluster's newest save of a path (``server/cluster/truth.py``) on the embedded coordinator:
the record only moves forward, a save's stamp names it exactly, and races are symmetric."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from ckptcache.format.manifest import object_digest
from ckptcache.server.cluster.coord import EmbeddedCoordinator, NodeInfo, keys
from ckptcache.server.cluster.coord.records import HolderRecord
from ckptcache.server.cluster.membership import path_hash
from ckptcache.server.cluster.truth import UNSEEN, Truth, races

STAMP = 1_765_000_000_123_456_789  # beyond a float's 53 bits: must stay exact


def _truth(store: dict, node: str) -> Truth:
    coord = EmbeddedCoordinator("/t/", 10.0, store)
    coord.join(NodeInfo(node, "h", ""))
    membership = SimpleNamespace(coord=coord, node=NodeInfo(node, "h", ""))
    return Truth(membership, threading.Event())  # type: ignore[arg-type]


def _gen(stamp: int, seen: int = 0, digests: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(namespace="ns", path="/p", number=1, committed_ns=stamp, origin="",
                           seen_ns=seen, digests=digests)  # fmt: skip


@pytest.mark.parametrize(
    ("a", "b", "raced"),
    [
        ((0, 10), (10, 20), False),  # b began after a completed (it saw a)
        ((0, 10), (5, 20), True),  # b saw an older save only: they overlapped
        ((UNSEEN, 10), (0, 20), False),  # a copy, or an older version's save: never a race
    ],
)
def test_two_saves_race_only_when_neither_saw_the_other(a, b, raced):
    assert races(*a, *b) is raced
    assert races(*b, *a) is raced


def test_the_record_moves_only_forward_and_keeps_the_stamp_exact():
    store: dict = {}
    a, b = _truth(store, "a"), _truth(store, "b")
    assert a.seen("ns", "/p") == 0 and a.newest("ns", "/p") is None
    a.publish(_gen(STAMP))
    assert b.seen("ns", "/p") == STAMP
    b.publish(_gen(STAMP + 1, seen=STAMP))
    a.publish(_gen(STAMP - 5))  # an older save's record arriving late: not the newest
    newest = a.newest("ns", "/p")
    assert newest is not None and (newest.node, newest.committed_ns) == ("b", STAMP + 1)


def test_same_content_is_known_from_the_holders_of_the_newest_save():
    store: dict = {}
    a = _truth(store, "a")
    ph, digest = path_hash("ns", "/p"), object_digest([1, 2])
    coord = a.membership.coord
    coord.announce(keys.holder_key(ph, digest, "b"),
                   HolderRecord("b", "/p", 3, 0.0, "", STAMP).to_dict())  # fmt: skip
    assert a.holds(_gen(STAMP - 9, digests=[1, 2]), STAMP)  # replicas: the same bytes
    assert not a.holds(_gen(STAMP - 9, digests=[1, 3]), STAMP)
    assert not a.holds(_gen(STAMP - 9, digests=[1, 2]), STAMP + 1)
