"""Striped backup pushes, peer fetches and relays (``data_plane_streams``) on real daemons in
network namespaces (tests/lab.py): the data plane between two nodes partitioned mid-push, the
pushing daemon killed with SIGKILL mid-push, the node serving a striped fetch partitioned from
the loader mid-fetch, and a member relaying a group's storage read in stripes partitioned or
killed with SIGKILL mid-relay. Each time the save or load returns or fails typed within a bound, no node serves a
mixture of two saves, and the next striped transfer after the fault delivers the same
bytes."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckptcache.errors import CkptCacheError
from tests.helpers import assert_same, wait_until
from tests.lab import S3_ENV, Lab, LabNode, in_netns, lab_available

pytestmark = pytest.mark.timeout(300)

CLIENT_TIMEOUT = 30.0
BOUND = CLIENT_TIMEOUT + 15.0
#: Slow enough that a 64 MiB push takes seconds (a fault lands inside it), fast enough that
#: the test takes seconds too.
MBIT = 150.0
STRIPED = "in 4 stripes"
RELAYED = "on 4 relay stripes)"  # the relaying node's line, not the receiving one's
HELD = "storages held here"  # a push sent less what the receiving node holds


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16 << 20, generator=g), "step": seed}  # 64 MiB


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    why = lab_available()
    if why:
        pytest.skip(why)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**S3_ENV, "AWS_ENDPOINT_URL_S3": "http://10.213.0.3:5000"}.items():
            mp.setenv(k, v)
        lab = Lab(3, node_mbit=MBIT, lease_ttl=2.0, dead_peer_timeout=3.0,
                  workdir=tmp_path_factory.mktemp("lab"), memory_limit="768MiB",
                  config="data_plane_streams: 4\nlog_level: DEBUG\n")  # fmt: skip
        with lab:
            yield lab


def _bounded(fn: Any) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND)
    assert not t.is_alive(), f"{fn} hung for more than {BOUND}s"
    return box.get("error", box.get("value"))


def save(node: LabNode, obj: Any, path: str, durability: str = "backup") -> Any:
    def run() -> Any:
        with node.daemon.client(fallback="raise", timeout=CLIENT_TIMEOUT) as c:
            return c.save(obj, path, durability=durability)

    return _bounded(lambda: in_netns(node.ns, run))


def load(node: LabNode, path: str) -> Any:
    def run() -> Any:
        with node.daemon.client(fallback="raise", timeout=CLIENT_TIMEOUT) as c:
            return c.load(path, mmap=False, verify=True)

    return _bounded(lambda: in_netns(node.ns, run))


def _push_under_way(b: LabNode, before: int) -> None:
    wait_until(lambda: b.daemon.log().count(STRIPED) > before, timeout=BOUND,
               interval=0.01, what="a striped push arriving")  # fmt: skip
    time.sleep(0.5)  # a few MiB of each stripe in


def _whole_or_typed(result: Any, *candidates: dict[str, Any]) -> None:
    if isinstance(result, BaseException):
        assert isinstance(result, CkptCacheError), repr(result)
        return
    matches = 0
    for want in candidates:
        try:
            assert_same(want, result)
            matches += 1
        except AssertionError:
            pass
    assert matches == 1, "the backup node served bytes of no whole save"


def test_partition_between_the_nodes_mid_striped_push(lab: Lab) -> None:
    a, b = lab.nodes[:2]
    path = "s3://lab/run/stripes-partition/model.pt"
    before = b.daemon.log().count(STRIPED)
    box: dict[str, Any] = {}
    saver = threading.Thread(target=lambda: box.update(r=save(a, state(1), path)))
    saver.start()
    _push_under_way(b, before)
    lab.partition(a, peers=[b])  # the data plane cut; both still reach etcd and storage
    saver.join(BOUND + 5)
    assert not saver.is_alive()
    result = box["r"]
    if isinstance(result, BaseException):
        assert isinstance(result, CkptCacheError), repr(result)
    _whole_or_typed(load(b, path), state(1))
    lab.heal()
    before = b.daemon.log().count(STRIPED)
    assert not isinstance(save(a, state(2), path), BaseException)
    assert b.daemon.log().count(STRIPED) > before
    assert_same(state(2), load(b, path))


def test_sender_killed_mid_striped_push(lab: Lab) -> None:
    lab.heal()
    a, b = lab.nodes[:2]
    path = "s3://lab/run/stripes-kill/model.pt"
    assert not isinstance(save(a, state(3), path), BaseException)  # a whole copy on b
    before = b.daemon.log().count(STRIPED)
    box: dict[str, Any] = {}
    saver = threading.Thread(target=lambda: box.update(r=save(a, state(4), path)))
    saver.start()
    _push_under_way(b, before)
    lab.kill(a)  # SIGKILL
    saver.join(BOUND + 5)
    assert not saver.is_alive()
    _whole_or_typed(load(b, path), state(3), state(4))
    lab.restart(a)
    lab.wait_formed()
    before = b.daemon.log().count(STRIPED)
    assert not isinstance(save(a, state(5), path), BaseException)
    assert b.daemon.log().count(STRIPED) > before
    assert_same(state(5), load(b, path))


def test_holder_partitioned_from_the_loader_mid_striped_fetch(lab: Lab) -> None:
    lab.heal()
    for node in lab.nodes:
        if node.daemon.proc is None or node.daemon.proc.poll() is not None:
            lab.restart(node)
    lab.wait_formed()
    a, b, c = lab.nodes
    path = "s3://lab/run/stripes-fetch/model.pt"
    assert not isinstance(save(a, state(6), path), BaseException)  # held by a and its backup
    before = c.daemon.log().count(STRIPED)
    box: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: box.update(r=load(c, path)))
    loader.start()
    _push_under_way(c, before)
    line = [ln for ln in c.daemon.log().splitlines() if STRIPED in ln][-1]
    serving = next(n for n in (a, b) if f"from {n.node_id} " in line)
    lab.partition(serving, peers=[c])  # the striped fetch's connections cut; storage stays
    loader.join(BOUND + 5)
    assert not loader.is_alive()
    _whole_or_typed(box["r"], state(6))
    lab.heal()
    assert_same(state(6), load(c, path))


def _striped_group_read(
    lab: Lab, path: str, seed: int
) -> tuple[dict[str, Any], LabNode, list[Any], list[threading.Thread]]:
    """Every member loads ``path``, an object only storage holds, read slowly enough that the
    others join while it lands: the object, the member seen relaying it in stripes (its log),
    and the loads' outcomes and threads (started, not joined)."""
    lab.heal()
    for node in lab.nodes:
        if node.daemon.proc is None or node.daemon.proc.poll() is not None:
            lab.restart(node)
    lab.wait_formed()
    obj = state(seed)
    buf = io.BytesIO()
    torch.save(obj, buf)
    lab.put(path, buf.getvalue())
    lab.throttle_storage(100)  # the read takes seconds
    before = [n.daemon.log().count(RELAYED) for n in lab.nodes]
    results: list[Any] = [None] * len(lab.nodes)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, load(lab.nodes[i], path)))
               for i in range(len(lab.nodes))]  # fmt: skip
    for t in threads:
        t.start()
    relaying = wait_until(
        lambda: next((n for n, b in zip(lab.nodes, before, strict=True)
                      if n.daemon.log().count(RELAYED) > b), None),
        timeout=BOUND, interval=0.01, what="a striped relay",
    )  # fmt: skip
    time.sleep(0.5)  # a few MiB of each stripe on their way
    return obj, relaying, results, threads


def test_member_killed_mid_striped_relay(lab: Lab) -> None:
    """The member relaying a group's storage read in stripes is killed with SIGKILL
    mid-relay: the others get the whole object from the rest of the group within the bound,
    and the killed member, restarted, loads it whole."""
    rate = lab.storage_mbit
    try:
        obj, relaying, results, threads = _striped_group_read(
            lab, "s3://lab/run/stripes-relay-kill/model.pt", 10
        )
        lab.kill(relaying)
    finally:
        lab.throttle_storage(rate)
    for n, t in zip(lab.nodes, threads, strict=True):
        t.join(BOUND + 10)
        assert not t.is_alive()
        if n is relaying:  # its client lost its daemon: a typed error, or the bytes
            _whole_or_typed(results[n.index], obj)
            continue
        assert not isinstance(results[n.index], BaseException), (n.node_id, results)
        assert_same(obj, results[n.index])
    lab.restart(relaying)
    lab.wait_formed()
    assert_same(obj, load(relaying, "s3://lab/run/stripes-relay-kill/model.pt"))


def test_member_partitioned_mid_striped_relay(lab: Lab) -> None:
    """Every member loads an object only storage holds; the read is relayed in stripes as it
    lands, and the member relaying it is cut off from everyone mid-relay: the others get the
    whole object from the rest of the group within the bound, the cut-off member the whole
    object or a typed error once healed."""
    path = "s3://lab/run/stripes-relay/model.pt"
    rate = lab.storage_mbit
    try:
        obj, relaying, results, threads = _striped_group_read(lab, path, 9)
        lab.partition(relaying)
    finally:
        lab.throttle_storage(rate)
    for n, t in zip(lab.nodes, threads, strict=True):
        if n is not relaying:  # served by the rest of the group meanwhile
            t.join(BOUND + 10)
            assert not t.is_alive()
            assert not isinstance(results[n.index], BaseException), (n.node_id, results)
            assert_same(obj, results[n.index])
    lab.heal(relaying)
    threads[relaying.index].join(BOUND + 10)
    assert not threads[relaying.index].is_alive()
    _whole_or_typed(results[relaying.index], obj)
    assert_same(obj, load(relaying, path))


def held_state(seed: int) -> dict[str, Any]:
    """32 MiB that every seed shares (a frozen part) and 32 MiB of its own."""
    frozen, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    return {"frozen": torch.randn(8 << 20, generator=frozen),
            "w": torch.randn(8 << 20, generator=own), "step": seed}  # fmt: skip


def test_partition_mid_push_less_what_is_held(lab: Lab) -> None:
    """The link cut while a push sends only what the backup node lacks (it copies the frozen
    part from its copy of the save before): the save ends within the bound, whole or typed;
    the backup node is left no pin and no reservation and serves whole saves; healed, the
    next push is sent less what is held again."""
    lab.heal()
    a, b = lab.nodes[:2]
    first, second, third = (f"s3://lab/run/held-partition/step-{i}.pt" for i in (1, 2, 3))
    assert not isinstance(save(a, held_state(1), first), BaseException)
    before = b.daemon.log().count(HELD)
    box: dict[str, Any] = {}
    saver = threading.Thread(target=lambda: box.update(r=save(a, held_state(2), second)))
    saver.start()
    wait_until(lambda: b.daemon.log().count(HELD) > before, timeout=BOUND, interval=0.01,
               what="a push less what is held arriving")  # fmt: skip
    time.sleep(0.3)  # some of the 32 MiB sent
    lab.partition(a, peers=[b])
    saver.join(BOUND + 5)
    assert not saver.is_alive()
    if isinstance(box["r"], BaseException):
        assert isinstance(box["r"], CkptCacheError), repr(box["r"])
    wait_until(lambda: b.daemon.status().pinned == 0 and b.daemon.status().reservations == 0,
               timeout=BOUND, what="the backup node's pins and reservation given back")  # fmt: skip
    _whole_or_typed(load(b, second), held_state(2))
    assert_same(held_state(1), load(b, first))
    lab.heal()
    before = b.daemon.log().count(HELD)
    assert not isinstance(save(a, held_state(3), third), BaseException)
    assert b.daemon.log().count(HELD) > before
    assert_same(held_state(3), load(b, third))
