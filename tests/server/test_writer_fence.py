"""The writer role's fence against a real etcd: while etcd cannot be reached the role holds
only on the strength of the lease it was held under, never on a lease taken after that one
lapsed (a representative cut off past its TTL, whose successor wrote and stepped down)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptcache.server.cluster.coord import (
    Coordinator,
    CoordinatorUnavailable,
    NodeInfo,
    keys,
    make_coordinator,
)
from ckptcache.server.cluster.coord.records import WriterRecord
from ckptcache.server.cluster.writer_fence import WriterFence
from ckptcache.server.persist.persister import Deposed

PH, DIGEST = "ph", "digest"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[object]:
    """A private etcd (the tests stop it to cut the node off)."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (apt-get install etcd-server)")
    from ckptcache.cli.benchmarking import EtcdServer

    (tmp_path / "etcd").mkdir()
    server = EtcdServer(tmp_path / "etcd" / "data").start()
    yield server
    server.stop()


@pytest.fixture
def coord(etcd: object) -> Iterator[Coordinator]:
    """Node ``a``, holding the writer role of the path under its first lease. A long TTL:
    the lease outlives the test however slow this host is, unless the test ends it."""
    url = f"etcd://127.0.0.1:{etcd.client_port}"  # type: ignore[attr-defined]
    node = make_coordinator(url, cluster=f"t{uuid.uuid4().hex[:8]}", job="j", ttl=60.0)
    try:
        node.join(NodeInfo("a", "h", ""))
        assert node.elect(keys.writer_key(PH), WriterRecord("a", DIGEST).to_dict())
        yield node
    finally:
        node.close()


def test_the_role_holds_through_an_outage_while_its_lease_lives(coord, etcd):
    fence = WriterFence(coord, PH, DIGEST, "a")
    fence.check()  # etcd answers: the record is ours
    etcd.stop()  # type: ignore[attr-defined]
    with pytest.raises(CoordinatorUnavailable):  # the role cannot be read any more...
        coord.get(keys.writer_key(PH))
    fence.check()  # ...yet it holds: the lease it was held under is alive
    assert fence.epoch == coord.lease_epoch() and coord.lease_remaining() > 30


def test_a_lease_taken_after_the_roles_lapsed_does_not_vouch_for_it(coord, etcd):
    fence = WriterFence(coord, PH, DIGEST, "a")
    coord._lease.revoke()  # type: ignore[attr-defined]  # lapsed, as past the TTL
    coord.announce("holders/p/d/a", {"node": "a"})  # the next request takes a new lease
    assert coord.get(keys.writer_key(PH)) is None  # the role went with the old lease
    assert coord.lease_remaining() > 30  # the new lease is alive and long
    etcd.stop()  # type: ignore[attr-defined]
    with pytest.raises(Deposed, match="the lease it was held under lapsed"):
        fence.check()


def test_a_role_taken_by_another_node_deposes_the_writer(coord):
    fence = WriterFence(coord, PH, DIGEST, "a")
    coord.record(keys.writer_key(PH), WriterRecord("b", DIGEST).to_dict())
    with pytest.raises(Deposed, match=r"held by b"):
        fence.check()
