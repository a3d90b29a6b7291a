"""The coordinator as it is deployed: etcd of three members, each node reaching them through a
gateway of its own (tests/lab.py, ``etcd_members=3``). A member is killed (kill -9), or the
leader is cut off from the other two while the nodes still reach it; meanwhile nodes save
successive generations of one path with ``durability="persisted"``, and load it.

Each test checks the promises of test_lab_faults.py: a save that returned is never lost (its
generation, or a newer one, is on storage and every node loads the newest); storage is
written once per generation (each stored version read back); every save and load returns or
fails typed within the bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ckptcache.errors import CkptCacheError
from tests.e2e.cluster.test_lab_faults import (
    AT_DEFAULTS,
    BOUND,
    DEAD_PEER,
    NODE_MBIT,
    PART_MIB,
    STORAGE_MBIT,
    TTL,
    Writes,
    _drop_s3_clients,
    assert_newest_or_typed,
    load,
    save,
    state,
    stored_object,
    stored_steps,
)
from tests.helpers import assert_same, wait_until
from tests.lab import S3_ENV, Lab, lab_available

pytestmark = pytest.mark.timeout(480 if AT_DEFAULTS else 180)


@pytest.fixture(scope="module")
def shared_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    why = lab_available()
    if why:
        pytest.skip(why)
    env = {**S3_ENV, "AWS_ENDPOINT_URL_S3": "http://10.213.0.3:5000"}  # for client reads
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        _drop_s3_clients()
        try:
            lab = Lab(3, node_mbit=NODE_MBIT, storage_mbit=STORAGE_MBIT, lease_ttl=TTL,
                      dead_peer_timeout=DEAD_PEER, workdir=tmp_path_factory.mktemp("lab3"),
                      memory_limit="256MiB", etcd_members=3,
                      config=f"s3_part_size: {PART_MIB}MiB\n")  # fmt: skip
            with lab:
                yield lab
        finally:
            _drop_s3_clients()


@pytest.fixture
def lab(shared_lab: Lab) -> Iterator[Lab]:
    """The shared lab, whole before each test: links healed, every etcd member up."""
    shared_lab.heal()
    for member in range(shared_lab.etcd_members):
        if not shared_lab.etcd_member_alive(member):
            shared_lab.restart_etcd_member(member)
    shared_lab.etcd_leader()
    shared_lab.wait_formed()
    yield shared_lab
    for watch in list(Writes.running):
        watch.stop()


@pytest.fixture
def url(request: pytest.FixtureRequest) -> str:
    return f"s3://lab/run/{request.node.name}/model.pt"


def _save_round(lab: Lab, url: str, first_step: int) -> dict[int, Any]:
    """Each node in turn saves the next generation of ``url`` (persisted) and every node then
    loads it: the steps acknowledged, with each save's outcome checked."""
    acked: dict[int, Any] = {}
    newest: Any = None
    for i, node in enumerate(lab.nodes):
        step = first_step + i
        obj = state(step)
        result = save(node, obj, url, "persisted")
        if isinstance(result, BaseException):
            assert isinstance(result, CkptCacheError), repr(result)
        else:
            acked[step], newest = obj, obj
        if newest is not None:
            for n in lab.nodes:  # the newest acknowledged, or a typed error
                assert_newest_or_typed(load(n, url), newest)
    return acked


def _check_after(lab: Lab, url: str, acked: dict[int, Any], writes: Writes) -> None:
    """Once whole: the newest acknowledged generation (or a newer one) is on storage and every
    node loads what storage holds; no generation was written twice."""
    assert acked, "no save was acknowledged"
    newest_step = max(acked)
    wait_until(
        lambda: stored_object(lab, url)["step"] >= newest_step, timeout=BOUND,
        what=f"generation {newest_step} or newer on storage",
    )  # fmt: skip
    writes.settle(quiet=4 * TTL)
    stored = stored_object(lab, url)
    for n in lab.nodes:
        assert_same(stored, load(n, url))
    steps = stored_steps(lab, url)
    assert all(count == 1 for count in steps.values()), steps
    assert set(acked) <= set(steps), (sorted(acked), steps)


def test_etcd_leader_killed(lab: Lab, url: str) -> None:
    """kill -9 of etcd's leader between saves: the two members left elect a leader, the
    gateways move to them, and saves and loads go on; the member restarts and rejoins."""
    writes = Writes(lab, url)
    acked = _save_round(lab, url, 100)
    lab.kill_etcd_member(lab.etcd_leader())
    acked |= _save_round(lab, url, 200)
    _check_after(lab, url, acked, writes)
    assert set(acked) >= {200, 201, 202}  # two of three members: nothing may fail


def test_etcd_leader_cut_off_from_the_other_members(lab: Lab, url: str) -> None:
    """etcd's leader is cut off from the other two members; nodes still reach all three, and
    a gateway may keep sending a node's requests to the old leader, which cannot serve them.
    Saves and loads succeed or fail typed within the bound; once healed, nothing
    acknowledged is lost and each generation is on storage once."""
    writes = Writes(lab, url)
    acked = _save_round(lab, url, 300)
    lab.isolate_etcd_member(lab.etcd_leader())
    acked |= _save_round(lab, url, 400)
    lab.heal()
    acked |= _save_round(lab, url, 500)
    _check_after(lab, url, acked, writes)
    assert set(acked) >= {500, 501, 502}  # healed: nothing may fail
