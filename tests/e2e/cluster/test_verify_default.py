"""Tier crossings on several daemons are verified by default, and an etcd outage is never
reported as a missing checkpoint.

* A damaged persisted file read for the group (one member reads storage, the others chain
  behind it or read it themselves) raises :class:`CorruptCheckpoint` on every node, naming
  the storage tier and the tensor, whichever region of the archive the flipped byte is in.
* A corrupt copy in a peer's memory, with no other tier to fall back to, is reported as such
  (tier ``peer``, the tensor), not as "not found".
* During a coordinator outage, a path that only other nodes hold gives a
  :class:`~ckptcache.errors.CoordinatorUnavailable` (a ``ConnectionError``) that says so, not a
  :class:`~ckptcache.errors.CheckpointNotFound` (a ``FileNotFoundError``).
"""

from __future__ import annotations

import pytest

from ckptcache import errors
from ckptcache.errors import CheckpointNotFound, CorruptCheckpoint
from tests.e2e.cluster.test_integrity import own_etcd  # noqa: F401 - fixture
from tests.e2e.cluster.test_restore import load_all
from tests.e2e.local.test_corrupt import flip_bytes_of, wait_digested
from tests.e2e.local.test_verify_default import REGIONS, assert_corrupt, flipped, regions, state
from tests.helpers import assert_same, wait_until


def test_damaged_file_read_for_the_group_is_refused_on_every_node(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    nodes = cluster_factory(2, "--persist-root", str(root), "--backup", "none")
    path = root / "m.pt"
    with nodes[0].client() as c:
        c.save(state(), path, durability="persisted")
        c.delete(path)
    good = path.read_bytes()
    for region in REGIONS:
        offset, tensor = regions(good)[region]
        path.write_bytes(flipped(good, offset))
        for i, result in enumerate(load_all(nodes, path)):  # one storage read for the group
            assert_corrupt(lambda r=result: _raise(r), tensor, f"{region}: node{i} load")
        with nodes[1].client() as c:
            assert_corrupt(lambda: c.prefetch(path), tensor, f"{region}: prefetch")
        for d in nodes:
            assert not d.status().objects, region  # nothing damaged was committed
    path.write_bytes(good)
    for result in load_all(nodes, path):
        assert_same(state(), _raise(result))


def _raise(result: object) -> object:
    if isinstance(result, BaseException):
        raise result
    return result


def test_corrupt_peer_copy_without_another_tier_is_reported_as_corrupt(cluster_factory, tmp_path):
    """Memory only (no persist root): node0's copy goes bad; node1's load must say the peer's
    copy was corrupt (tier and tensor), not that the checkpoint does not exist."""
    a, b = cluster_factory(2, "--backup", "none", "--memory-only", "allow")
    path = tmp_path / "m.pt"
    with a.client() as ca:
        ca.save(state(), path)
        wait_digested(ca, str(path))
        assert flip_bytes_of(a, ca, str(path), 1) == "model.head"
    with b.client() as cb:
        with pytest.raises(CorruptCheckpoint, match=r"peer.*model\.head") as e:
            cb.load(path)
        assert e.value.tier == "peer" and e.value.tensor == "model.head"
    wait_until(lambda: "corrupt copy" in a.log())  # reported to its holder, which dropped it


def test_coordinator_outage_is_not_reported_as_a_missing_checkpoint(
    own_etcd,  # noqa: F811 - the fixture imported above
    cluster_factory,
    tmp_path,
):
    # own_etcd first: it is torn down after the daemons, which leave it cleanly.
    a, b = cluster_factory(2, "--backup", "none", "--memory-only", "allow", etcd=own_etcd)
    path = tmp_path / "only-on-node0.pt"  # under no persist root: only node0's memory has it
    with a.client() as ca:
        ca.save(state(), path)
        wait_digested(ca, str(path))
    own_etcd.stop()
    with b.client() as cb:
        for call in (lambda: cb.load(path), lambda: cb.prefetch(path)):
            with pytest.raises(ConnectionError, match="coordinator is unreachable") as e:
                call()
            assert isinstance(e.value, getattr(errors, "CoordinatorUnavailable", ()))
            assert not isinstance(e.value, FileNotFoundError)
        with pytest.raises(CheckpointNotFound):  # the local answer needs no coordinator
            cb.status(path)
    own_etcd.start()
    with b.client() as cb:  # back: the peer's copy is found again
        wait_until(lambda: cb.prefetch(path) == ["peer"], timeout=60)
        assert_same(state(), cb.load(path))
