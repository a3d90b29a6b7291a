"""One conformance suite for every coordinator: embedded and a real etcd."""

from __future__ import annotations

import json
import threading
import uuid

import pytest

from ckptcache.server.cluster.coord import (
    CoordinatorUnavailable,
    EmbeddedCoordinator,
    NodeInfo,
    make_coordinator,
)
from ckptcache.server.cluster.coord.counting import CountingCoordinator
from tests.helpers import wait_until


class Conformance:
    """Subclasses provide ``make()``: a new coordinator on the same store."""

    def make(self):
        raise NotImplementedError

    def test_membership(self):
        a, b = self.make(), self.make()
        a.join(NodeInfo("a", "h1", "127.0.0.1:1"))
        b.join(NodeInfo("b", "h2", ""))
        assert [n.node_id for n in a.live_nodes()] == ["a", "b"]
        assert b.live_nodes()[0] == NodeInfo("a", "h1", "127.0.0.1:1")
        b.close()
        wait_until(lambda: [n.node_id for n in a.live_nodes()] == ["a"])
        a.close()

    def test_election_has_one_winner_until_the_lease_ends(self):
        a, b = self.make(), self.make()
        a.join(NodeInfo("a", "h", ""))
        b.join(NodeInfo("b", "h", ""))
        assert a.elect("reps/x", {"node": "a"}) is True
        assert b.elect("reps/x", {"node": "b"}) is False
        assert b.get("reps/x") == {"node": "a"}
        a.close()  # the winner goes away: its election ends with its lease
        wait_until(lambda: b.get("reps/x") is None)
        assert b.elect("reps/x", {"node": "b"}) is True
        b.close()

    def test_only_the_holder_releases_a_role(self):
        a, b = self.make(), self.make()
        a.join(NodeInfo("a", "h", ""))
        b.join(NodeInfo("b", "h", ""))
        assert a.elect("writer/x", {"node": "a"}) is True
        assert b.release("writer/x") is False  # not b's: a keeps it
        assert b.get("writer/x") == {"node": "a"}
        assert b.release("writer/never") is False
        assert a.release("writer/x") is True
        assert a.get("writer/x") is None
        # b takes the role; a, the former holder, must not take it away from b.
        assert b.elect("writer/x", {"node": "b"}) is True
        assert a.release("writer/x") is False
        assert a.get("writer/x") == {"node": "b"}
        a.close()  # closing ends a's roles only
        assert b.get("writer/x") == {"node": "b"}
        b.close()

    def test_advance_moves_a_record_only_forward_and_loses_no_put(self):
        a, b = self.make(), self.make()
        a.join(NodeInfo("a", "h", ""))
        b.join(NodeInfo("b", "h", ""))
        stamp = 1_765_000_000_123_456_789  # a stamp in ns: beyond a float's 53 bits
        assert a.advance("latest/p", {"node": "a", "ns": stamp}, "ns") == (True, None)
        assert b.advance("latest/p", {"node": "b", "ns": stamp}, "ns") == (
            False, {"node": "a", "ns": stamp},
        )  # fmt: skip
        assert b.advance("latest/p", {"node": "b", "ns": stamp + 1}, "ns") == (
            True, {"node": "a", "ns": stamp},
        )  # fmt: skip
        assert a.get("latest/p") == {"node": "b", "ns": stamp + 1}  # exact, not a float's
        # Racing advances: every one lands or finds a newer one, and the newest stays.
        results: list[bool] = []
        threads = [
            threading.Thread(target=lambda c=c, i=i: results.append(
                c.advance("latest/q", {"ns": stamp + i}, "ns")[0]))
            for i, c in enumerate([a, b] * 8)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert a.get("latest/q") == {"ns": stamp + 15} and True in results
        a.record("latest/r", {"ns": "not a number"})  # a hand edit: counts as the oldest
        assert a.advance("latest/r", {"ns": 1}, "ns")[0] is True
        a.close()
        b.close()

    def test_records_are_durable_and_scans_are_relative(self):
        a, b = self.make(), self.make()
        a.join(NodeInfo("a", "h", ""))
        b.join(NodeInfo("b", "h", ""))
        a.record("persisted/p/d1", {"path": "/x"})
        a.announce("holders/p/d1/a", {"node": "a"})
        a.close()
        assert b.get("persisted/p/d1") == {"path": "/x"}
        wait_until(lambda: b.scan("holders/") == {})
        b.announce("holders/p/d1/b", {"node": "b"})
        assert b.scan("holders/p/") == {"holders/p/d1/b": {"node": "b"}}
        b.withdraw("holders/p/d1/b")
        assert b.scan("holders/") == {}
        assert b.healthy()
        b.close()


class TestEmbedded(Conformance):
    @pytest.fixture(autouse=True)
    def _store(self):
        self.store: dict = {}

    def make(self):
        return EmbeddedCoordinator("/ckptcache/t/j/", 1.0, store=self.store)


class TestEtcd(Conformance):
    @pytest.fixture(autouse=True)
    def _etcd(self, etcd_server):
        self.url = etcd_server.url
        self.cluster = uuid.uuid4().hex[:8]

    def make(self):
        # The daemon's default TTL: a keep-alive starved for a second on a busy host must not
        # lapse a lease mid-test (closing revokes it; only the cut-off test waits it out).
        return make_coordinator(self.url, cluster=self.cluster, job="j", ttl=5.0)

    def test_membership_reads_carry_only_what_changed(self):
        a, b, c = self.make(), self.make(), self.make()
        for coord, name in ((a, "a"), (b, "b"), (c, "c")):
            coord.join(NodeInfo(name, "h", ""))
        assert [n.node_id for n in a.live_nodes()] == ["a", "b", "c"]
        returned: list[int] = []  # node records in each membership answer
        post = a._client.post

        def counting(url, *args, **kw):
            out = post(url, *args, **kw)
            if url.endswith("/kv/range"):
                returned.append(len(out.get("kvs", [])))
            return out

        a._client.post = counting
        assert [n.node_id for n in a.live_nodes()] == ["a", "b", "c"]
        assert returned == [0]  # nothing changed: no node record travels (all three before)
        d = self.make()
        d.join(NodeInfo("d", "h2", "127.0.0.1:9"))
        assert a.live_nodes()[3] == NodeInfo("d", "h2", "127.0.0.1:9")
        assert returned == [0, 1]
        b.close()  # a node leaves and another joins between two reads: the count catches it
        e = self.make()
        e.join(NodeInfo("e", "h", ""))
        assert [n.node_id for n in a.live_nodes()] == ["a", "c", "d", "e"]
        assert [n.node_id for n in a.live_nodes()] == ["a", "c", "d", "e"]
        assert returned[-1] == 0
        for coord in (a, c, d, e):
            coord.close()

    def test_a_hand_written_value_reads_as_an_empty_record_and_no_node(self):
        """What no daemon writes (not JSON, not an object, a node record without a host)
        is present but empty to a reader, and never listed as a node to dial."""
        a = self.make()
        a.join(NodeInfo("a", "h", ""))
        assert [n.node_id for n in a.live_nodes()] == ["a"]  # the view is read once ...
        a._client.put(a.prefix + "persisted/p/d", "not json")
        a._client.put(a.prefix + "writer/p", "[1, 2]")
        a._client.put(a.prefix + "nodes/forged", json.dumps({"node_id": "forged"}))
        a._client.put(a.prefix + "nodes/junk", "{")
        assert a.get("persisted/p/d") == {}
        assert a.scan("writer/") == {"writer/p": {}}
        assert [n.node_id for n in a.live_nodes()] == ["a"]  # ... then only what changed
        b = self.make()
        b.join(NodeInfo("b", "h", ""))
        assert [n.node_id for n in b.live_nodes()] == ["a", "b"]  # read whole
        assert [n.node_id for n in a.live_nodes()] == ["a", "b"]
        a.close()
        b.close()

    def test_a_lease_etcd_forgot_is_taken_again_by_the_next_request(self):
        # A long TTL: the node stays healthy in its own eyes however slow this host is.
        a = make_coordinator(self.url, cluster=self.cluster, job="j", ttl=60.0)
        b = self.make()
        a.join(NodeInfo("a", "h", ""))
        b.join(NodeInfo("b", "h", ""))
        a.announce("holders/p/d/a", {"node": "a"})
        a._stop.set()  # no keep-alive thread to notice: only the request path can recover
        a._thread.join()
        a._lease.revoke()  # etcd forgets a's lease, as after a stall longer than the TTL
        assert b.get("holders/p/d/a") is None and b.get("nodes/a") is None
        a.announce("holders/q/d/a", {"node": "a"})  # was: CoordinatorUnavailable (Not Found)
        assert b.get("holders/q/d/a") == {"node": "a"}
        assert b.get("holders/p/d/a") == {"node": "a"}  # everything re-announced
        assert [n.node_id for n in b.live_nodes()] == ["a", "b"]
        a._lease.revoke()
        assert a.elect("reps/p", {"node": "a"}) is True  # an election re-takes it too
        assert b.get("reps/p") == {"node": "a"}
        a.close()
        b.close()

    def test_lease_expires_when_a_node_is_cut_off(self):
        a, b = self.make(), self.make()
        a.join(NodeInfo("a", "h", ""))
        b.join(NodeInfo("b", "h", ""))
        assert a.elect("reps/y", {"node": "a"})
        a._stop.set()  # stop refreshing: as if a lost its link to etcd
        wait_until(lambda: b.get("reps/y") is None, timeout=15)
        wait_until(lambda: not a.healthy(), 15, "a to see that its lease ran out")
        assert a.elect("reps/y", {"node": "a"}) is False  # a cut-off node never claims
        b.close()


def test_embedded_wait_change_returns_when_another_instance_writes():
    store: dict = {}
    a = EmbeddedCoordinator("/ckptcache/t/j/", 1.0, store=store)
    b = EmbeddedCoordinator("/ckptcache/t/j/", 1.0, store=store)
    a.join(NodeInfo("a", "h", ""))
    woke = threading.Event()

    def waiter():
        a.wait_change(600.0)  # far longer than the test may take: only the write ends it
        woke.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    # Written until the waiter wakes (it may not be waiting yet when the first write lands).
    wait_until(lambda: b.announce("holders/p/inflight/b", {"node": "b"}) or woke.is_set(),
               timeout=30)  # fmt: skip
    assert a.scan("holders/p/") == {"holders/p/inflight/b": {"node": "b"}}  # NUL key hidden
    a.close()
    b.close()


def test_counting_coordinator_counts_each_request_in_total_and_per_scope():
    inner = EmbeddedCoordinator("/ckptcache/t/j/", 1.0)
    seen: list[str] = []
    coord = CountingCoordinator(inner, seen.append)
    coord.join(NodeInfo("a", "h", ""))
    with coord.tally() as outer:
        assert coord.elect("loads/p", {"node": "a"}) is True
        with coord.tally() as inner_scope:
            coord.scan("holders/p/")
            coord.live_nodes()
        other = threading.Thread(target=coord.get, args=("loads/p",))  # another thread's
        other.start()
        other.join()
    assert dict(inner_scope) == {"scan": 1, "live_nodes": 1}
    assert dict(outer) == {"elect": 1, "scan": 1, "live_nodes": 1}
    assert coord.totals == {"join": 1, "elect": 1, "scan": 1, "live_nodes": 1, "get": 1}
    assert sorted(seen) == sorted(coord.totals.elements())
    assert coord.get("loads/p") == {"node": "a"} and coord.prefix == inner.prefix
    coord.close()
    assert inner.scan("") == {}  # closing the wrapper closed the coordinator (lease ended)


def test_an_announcement_made_while_etcd_is_down_lands_once_it_is_back(tmp_path):
    """A holder announced during a short etcd outage (its put fails) is put by the
    keep-alive once etcd answers again, under the same lease: peers find the holder without
    the node announcing anything anew (a lost announcement left a copy nobody could find)."""
    from ckptcache.cli.benchmarking import EtcdServer

    (tmp_path / "etcd").mkdir()
    etcd = EtcdServer(tmp_path / "etcd" / "data").start()
    url, cluster = f"etcd://127.0.0.1:{etcd.client_port}", f"t{uuid.uuid4().hex[:8]}"
    # A TTL longer than the outage: the lease survives it, so nothing is re-taken.
    a = make_coordinator(url, cluster=cluster, job="j", ttl=10.0)
    b = make_coordinator(url, cluster=cluster, job="j", ttl=10.0)
    try:
        a.join(NodeInfo("a", "h", ""))
        b.join(NodeInfo("b", "h", ""))
        lease = a._lease.id
        etcd.stop()
        with pytest.raises(CoordinatorUnavailable):
            a.announce("holders/p/d/a", {"node": "a"})
        etcd.start()
        wait_until(lambda: b.get("holders/p/d/a") == {"node": "a"}, what="the late put")
        assert a._lease.id == lease
        a.withdraw("holders/p/d/a")  # a withdrawn key is not sent again
        assert b.get("holders/p/d/a") is None
    finally:
        a.close()
        b.close()
        etcd.stop()
