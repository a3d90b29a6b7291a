"""Network faults on real daemons in network namespaces (tests/lab.py): partitions, one-way
partitions, a coordinator cut off from half the nodes, a link slowed to a trickle, a lossy
link, a coordinator that refuses connections, storage cut off from the representative, and a
kill -9 during a partition (a three-member etcd: test_lab_etcd_members.py).

Every test checks the same four promises:

* no acknowledged checkpoint is lost (a save that returned is loadable, and persisted);
* storage is written once per content (the bucket is versioned: every write is a version);
* every load returns the newest acknowledged bytes or a typed error (``CkptCacheError``),
  within a bound (:data:`BOUND`), never a hang;
* the cluster recovers once the fault is gone.

All tests share one lab (module scope); each uses its own paths, and the ``lab`` fixture heals
every link, restores every rate and restarts every killed daemon before each test. Faults are
injected at points the test waits for (a log line, a persist state), or, where no such point
is visible, a fixed delay into a transfer that a throttled link stretches to several seconds.
"Written once" is counted after a quiet window of 2 TTLs with no write (:class:`Writes`),
watched from the heal on while the test checks its loads.

The daemons run with a 2 s lease and a 3 s dead-peer time, so the file takes about three
minutes. ``CKPTCACHE_LAB_DEFAULTS=1`` runs it at the daemon's own defaults (``lease_ttl`` and
``dead_peer_timeout`` of :class:`~ckptcache.server.config.DaemonConfig`), the slow run whose
times benchmarks/cluster/README.md reports::

    CKPTCACHE_LAB_DEFAULTS=1 python -m pytest tests/e2e/cluster/test_lab_faults.py \
        tests/e2e/cluster/test_lab_etcd_members.py --durations=0
"""

from __future__ import annotations

import collections
import io
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ckptcache.errors import CkptCacheError, CoordinatorUnavailable
from ckptcache.server.config import DaemonConfig
from tests.helpers import assert_same, wait_until
from tests.lab import S3_ENV, Lab, LabNode, in_netns, lab_available

#: ``CKPTCACHE_LAB_DEFAULTS=1``: the daemons run at their default lease and dead-peer time.
AT_DEFAULTS = os.environ.get("CKPTCACHE_LAB_DEFAULTS", "") == "1"

pytestmark = pytest.mark.timeout(480 if AT_DEFAULTS else 180)

#: A client's request timeout here: the daemon must answer (or fail typed) within it.
CLIENT_TIMEOUT = 30.0
#: The longest any single operation may take under a fault before it counts as a hang.
BOUND = CLIENT_TIMEOUT + 15.0
NODE_MBIT = 200.0
STORAGE_MBIT = 400.0
TTL = DaemonConfig.lease_ttl if AT_DEFAULTS else 2.0
#: The daemons' dead-peer time (``dead_peer_timeout``): what an operator on a quiet, fast
#: fabric sets; every fault that cuts a transfer is found in this time (default 10 s).
DEAD_PEER = DaemonConfig.dead_peer_timeout if AT_DEFAULTS else 3.0
#: The share of packets a lossy link drops, each way (%).
LOSS = 10
#: S3's smallest part: objects of a few parts are multipart uploads, whose completion is
#: fenced by the writer role (a single PUT in flight is not: see the README's Guarantees).
PART_MIB = 5


def state(seed: int, mib: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib << 18, generator=g), "step": seed}


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
            yield from _lab(tmp_path_factory)
        finally:
            _drop_s3_clients()


def _drop_s3_clients() -> None:
    """Forget this process's cached S3 backends. Their clients keep the endpoint and
    credentials of the environment they were built in: one built for the lab's reads would
    otherwise serve a later test's reads of the session's S3 server (404s), and one built
    before would serve the lab's."""
    from ckptcache.storage.registry import forget_backends

    forget_backends("s3", "s3a")


def _lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lab = Lab(4, node_mbit=NODE_MBIT, storage_mbit=STORAGE_MBIT, lease_ttl=TTL,
              dead_peer_timeout=DEAD_PEER, workdir=tmp_path_factory.mktemp("lab"),
              memory_limit="256MiB",
              config=f"s3_part_size: {PART_MIB}MiB\n")  # fmt: skip
    with lab:
        yield lab


@pytest.fixture
def lab(shared_lab: Lab) -> Iterator[Lab]:
    """The shared lab, whole (healed, rates back, every daemon up) before each test: what a
    test left broken is mended before the next one, not after the last."""
    shared_lab.heal()
    shared_lab.throttle_storage(STORAGE_MBIT)
    dead = []
    for node in shared_lab.nodes:
        if node.mbit != NODE_MBIT:
            shared_lab.throttle(node, NODE_MBIT)
        proc = node.daemon.proc
        if proc is None or proc.poll() is not None:
            node.daemon.spawn()
            dead.append(node)
    for node in dead:
        node.daemon.wait_ready()
    shared_lab.wait_formed()
    yield shared_lab
    for watch in list(Writes.running):  # a test that failed before its settle()
        watch.stop()


@pytest.fixture
def url(request: pytest.FixtureRequest) -> str:
    """A path of this test's own in the lab's bucket."""
    return f"s3://lab/run/{request.node.name}/model.pt"


def bounded(fn: Callable[[], Any], bound: float = BOUND) -> Any:
    """``fn()``'s result or exception, asserting it came back within ``bound`` seconds."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"{fn} hung for more than {bound}s"
    return box.get("error", box.get("value"))


def load(
    node: LabNode, path: str, timeout: float = CLIENT_TIMEOUT, *, allow_stale: bool = False
) -> Any:
    """Load ``path`` as a trainer on ``node`` does: through its daemon, from inside the node's
    namespace (a read the client makes of storage itself goes over the node's link). The
    object, or the exception it raised. ``allow_stale``: the trainer accepts a possibly older
    copy while the node cannot reach the coordinator."""

    def run() -> Any:
        with node.daemon.client(fallback="raise", timeout=timeout, allow_stale=allow_stale) as c:
            return c.load(path, mmap=False)

    return bounded(lambda: in_netns(node.ns, run), timeout + 15)


def assert_newest_or_typed(result: Any, expected: Any) -> None:
    """A load's outcome: the newest acknowledged bytes, or a typed ckptcache error."""
    if isinstance(result, BaseException):
        assert isinstance(result, CkptCacheError), repr(result)
    else:
        assert_same(expected, result)


def save(node: LabNode, obj: Any, path: str, durability: str = "local") -> Any:
    """Save through ``node``'s daemon; the generation number, or the exception."""

    def run() -> Any:
        with node.daemon.client(fallback="raise", timeout=CLIENT_TIMEOUT) as c:
            return c.save(obj, path, durability=durability)

    return bounded(run)


def info(node: LabNode, path: str) -> Any:
    return node.daemon.info(path)


def persisted_everywhere(lab: Lab, nodes: list[LabNode], path: str) -> None:
    """Every listed node holding ``path`` reports it persisted, and storage has it."""
    wait_until(lambda: lab.versions(path) >= 1, timeout=BOUND, what=f"{path} on storage")
    wait_until(
        lambda: all(info(n, path).persist_state in ("persisted", "") for n in nodes),
        timeout=BOUND, what=f"{path} persisted on every holder",
    )  # fmt: skip


def stored_object(lab: Lab, path: str) -> Any:
    import io

    return torch.load(io.BytesIO(lab.get(path)), weights_only=True)


class Writes:
    """The writes of a path to storage, counted in the background from the moment this is
    made: the quiet window in which a deposed representative's late write would land runs
    while the test goes on checking loads, instead of after them.

    Make it at the point the window must start (the heal, the fault, the save), then
    :meth:`settle` when every other check is done.
    """

    #: Watches not yet settled (the ``lab`` fixture stops those a failed test left).
    running: set[Writes] = set()

    def __init__(self, lab: Lab, path: str, interval: float = 0.5):
        self._lab, self._path, self._interval = lab, path, interval
        self.count = lab.versions(path)
        self._changed = time.monotonic()  # the window starts now, whatever came before
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        Writes.running.add(self)

    def stop(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        self._thread.join()
        Writes.running.discard(self)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                now = self._lab.versions(self._path)
            except Exception:  # storage unreachable for a moment: settle's own read reports it
                continue
            with self._lock:
                if now != self.count:
                    self.count, self._changed = now, time.monotonic()

    def settle(self, quiet: float = 2 * TTL) -> int:
        """The number of writes once nothing has written the path for ``quiet`` seconds,
        counted from this watch's start or its last change, whichever is later."""
        try:
            while True:
                with self._lock:
                    left = self._changed + quiet - time.monotonic()
                if left > 0:
                    time.sleep(min(left, self._interval))
                    continue
                final = self._lab.versions(self._path)  # what the last poll may have missed
                with self._lock:
                    if final == self.count:
                        return final
                    self.count, self._changed = final, time.monotonic()
        finally:
            self.stop()


# ---- the scenarios -------------------------------------------------------------------------


def test_partition_during_backup_push(lab: Lab, url: str) -> None:
    """The saver is cut off while it pushes the backup copy: the save returns or fails typed
    within the bound; once healed, the object is persisted once and every node loads it."""
    a = lab.nodes[0]
    lab.throttle(a, 16)  # ~4 s for the 8 MiB push
    obj = state(1, mib=8)
    box: dict[str, Any] = {}
    saver = threading.Thread(target=lambda: box.update(r=save(a, obj, url, "backup")))
    saver.start()
    time.sleep(1.0)  # the push is under way (a fixed point: no log line marks its middle)
    lab.partition(a)
    saver.join(BOUND + 5)
    assert not saver.is_alive()
    result = box["r"]
    if isinstance(result, BaseException):
        assert isinstance(result, CkptCacheError), repr(result)
    # Cut off, the node cannot know whether another saved the path since: it says so, and
    # serves its copy to a trainer that accepts that (the local copy is there either way).
    assert isinstance(load(a, url), CoordinatorUnavailable)
    assert_same(obj, load(a, url, allow_stale=True))
    lab.heal(a)
    lab.throttle(a, NODE_MBIT)
    writes = Writes(lab, url)  # from the heal on
    persisted_everywhere(lab, [a], url)
    for n in lab.nodes:
        assert_same(obj, load(n, url))
    assert writes.settle() == 1


def _representative(lab: Lab, path: str) -> LabNode:
    return wait_until(
        lambda: next((n for n in lab.nodes if info(n, path).persist_state == "persisting"), None),
        timeout=BOUND, interval=0.02, what="a representative persisting",
    )  # fmt: skip


def test_short_partition_of_the_representative_mid_persist(lab: Lab, url: str) -> None:
    """The representative is cut off for less than its lease while it uploads: it keeps the
    role, finishes, and storage is written once."""
    a = lab.nodes[0]
    lab.throttle_storage(16)  # the upload takes seconds
    obj = state(2, mib=3 * PART_MIB)
    assert not isinstance(save(a, obj, url, "backup"), BaseException)
    rep = _representative(lab, url)
    lab.partition(rep)
    time.sleep(TTL / 3)  # shorter than the lease: one missed keep-alive at most
    lab.heal(rep)
    lab.throttle_storage(STORAGE_MBIT)
    writes = Writes(lab, url)  # from the heal on
    holders = [a, *[n for n in lab.nodes if n.node_id in info(a, url).replicas]]
    persisted_everywhere(lab, holders, url)
    assert_same(obj, stored_object(lab, url))
    for n in lab.nodes:
        assert_same(obj, load(n, url))
    assert writes.settle() == 1


def test_partition_of_the_representative_healed_after_its_lease_expired(lab: Lab, url: str) -> None:
    """The representative is cut off mid-upload until a standby has taken over and written the
    object; after the heal the old representative must not write it again."""
    a = lab.nodes[0]
    lab.throttle_storage(16)
    obj = state(3, mib=3 * PART_MIB)
    assert not isinstance(save(a, obj, url, "backup"), BaseException)
    rep = _representative(lab, url)
    lab.partition(rep)
    lab.throttle_storage(STORAGE_MBIT)
    others = [n for n in lab.nodes if n is not rep]
    wait_until(lambda: lab.versions(url) >= 1, timeout=BOUND, what="the standby's write")
    for n in others:  # loads elsewhere meanwhile: the stored (newest) bytes
        assert_same(obj, load(n, url))
    assert_newest_or_typed(load(rep, url), obj)  # its own memory copy, still
    lab.heal(rep)
    writes = Writes(lab, url)  # from the heal on
    wait_until(lambda: info(rep, url).persist_state == "persisted", timeout=BOUND,
               what="the old representative learning of the new one's write")  # fmt: skip
    assert writes.settle(quiet=4 * TTL) == 1
    assert_same(obj, stored_object(lab, url))


def _load_on(nodes: list[LabNode], path: str) -> tuple[list[Any], list[threading.Thread]]:
    """Loads of ``path`` on ``nodes`` at once (started, not joined): the outcomes, in order."""
    results: list[Any] = [None] * len(nodes)
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, load(nodes[i], path)))
        for i in range(len(nodes))
    ]
    for t in threads:
        t.start()
    return results, threads


def _group_load(lab: Lab, path: str) -> tuple[list[Any], list[threading.Thread]]:
    return _load_on(lab.nodes, path)


def _log_with(lab: Lab, text: str) -> LabNode:
    return wait_until(
        lambda: next((n for n in lab.nodes if text in n.daemon.log()), None),
        timeout=BOUND, interval=0.02, what=text,
    )  # fmt: skip


def _seed_storage(lab: Lab, path: str, obj: Any) -> None:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    lab.put(path, buf.getvalue())


def test_partition_of_the_group_reader_mid_broadcast(lab: Lab, url: str) -> None:
    """Every node restarts and loads an object only storage holds; the node reading it for the
    group is cut off mid-read. The others get the bytes (another reads once the reader's lease
    is gone); the reader gets them or a typed error; nothing is written to storage."""
    obj = state(4, mib=8)
    _seed_storage(lab, url, obj)
    lab.throttle_storage(24)  # ~3 s for the read
    results, threads = _group_load(lab, url)
    reader = _log_with(lab, f"reading {url} from storage")
    lab.partition(reader)
    lab.throttle_storage(STORAGE_MBIT)
    for n, t in zip(lab.nodes, threads, strict=True):
        if n is not reader:  # served by the rest of the group meanwhile
            t.join(BOUND + 10)
            assert not isinstance(results[n.index], BaseException), (n.node_id, results)
            assert_same(obj, results[n.index])
    lab.heal(reader)
    writes = Writes(lab, url)  # from the heal on
    threads[reader.index].join(BOUND + 10)  # the cut-off node: bytes or a typed error
    assert not threads[reader.index].is_alive()
    assert_newest_or_typed(results[reader.index], obj)
    assert_same(obj, load(reader, url))
    assert writes.settle() == 1  # the seeded write only


def test_partition_of_a_relay_mid_broadcast(lab: Lab, url: str) -> None:
    """A node relaying the group's object while it still arrives is cut off: the nodes
    downstream of it get the bytes from another member within the bound."""
    obj = state(5, mib=8)
    _seed_storage(lab, url, obj)
    lab.throttle_storage(24)
    results, threads = _group_load(lab, url)
    relay = _log_with(lab, f"relaying {url} to a peer while it arrives")
    lab.partition(relay)
    lab.throttle_storage(STORAGE_MBIT)
    for n, t in zip(lab.nodes, threads, strict=True):
        if n is not relay:  # served by the rest of the group meanwhile
            t.join(BOUND + 10)
            assert not isinstance(results[n.index], BaseException), (n.node_id, results)
            assert_same(obj, results[n.index])
    lab.heal(relay)
    writes = Writes(lab, url)  # from the heal on
    threads[relay.index].join(BOUND + 10)  # the cut-off node: bytes or a typed error
    assert not threads[relay.index].is_alive()
    assert_newest_or_typed(results[relay.index], obj)
    assert writes.settle() == 1


def test_one_way_partition_of_a_saver(lab: Lab, url: str) -> None:
    """A node that can send but hears nothing (its keep-alives may still reach etcd) holds a
    checkpoint it saved and backed up before: the group still persists it once, other nodes
    load it, and its own loads answer from memory or fail typed."""
    a = lab.nodes[0]
    obj = state(6, mib=3 * PART_MIB)
    assert not isinstance(save(a, obj, url, "backup"), BaseException)
    lab.partition(a, direction="in")
    others = [n for n in lab.nodes if n is not a]
    wait_until(lambda: lab.versions(url) >= 1, timeout=BOUND, what="a write of the group")
    for n in others:
        assert_same(obj, load(n, url))
    assert_newest_or_typed(load(a, url), obj)
    lab.heal(a)
    writes = Writes(lab, url)  # from the heal on
    assert_same(obj, stored_object(lab, url))
    assert writes.settle() == 1


def test_one_way_partition_the_other_way(lab: Lab, url: str) -> None:
    """Nothing a node sends arrives (it still hears everyone): a save it acknowledges locally
    during the cut is persisted once after the heal, and its next save replaces it
    everywhere."""
    a = lab.nodes[0]
    lab.partition(a, direction="out")
    old = state(7)
    assert not isinstance(save(a, old, url), BaseException)  # durability local: acknowledged
    assert isinstance(load(a, url), CoordinatorUnavailable)  # nothing it asks etcd arrives
    assert_same(old, load(a, url, allow_stale=True))
    lab.heal(a)
    writes = Writes(lab, url)  # from the heal on, through both generations
    persisted_everywhere(lab, [a], url)
    assert lab.versions(url) == 1
    new = state(8)
    assert not isinstance(save(a, new, url, "persisted"), BaseException)
    for n in lab.nodes:
        assert_same(new, load(n, url))
    assert_same(new, stored_object(lab, url))
    # Each generation written once: the new one is (its save was acknowledged persisted), the
    # old one was, and nothing wrote either again in a quiet window after the last write; a
    # late copy of the old one, before or after the new save, would make this 3.
    assert writes.settle() == 2


def test_coordinator_cut_off_from_half_the_nodes(lab: Lab, url: str) -> None:
    """etcd is unreachable from nodes 0 and 1: they keep saving, and load from memory what a
    trainer accepts as possibly stale (else CoordinatorUnavailable); the other half persists
    what it saves; once healed, the cut-off nodes' saves are persisted
    once and every node loads the newest."""
    cut, whole = lab.nodes[:2], lab.nodes[2:]
    lab.partition_coordinator(cut)
    mine = url.replace("model.pt", "cut.pt")
    obj_cut, obj_whole = state(9), state(10)
    assert not isinstance(save(cut[0], obj_cut, mine), BaseException)
    assert isinstance(load(cut[0], mine), CoordinatorUnavailable)
    assert_same(obj_cut, load(cut[0], mine, allow_stale=True))
    assert not isinstance(save(whole[0], obj_whole, url, "persisted"), BaseException)
    for n in whole:  # through storage or peers
        assert_same(obj_whole, load(n, url))
    # The cut half: the bytes or a typed error, each after its coordinator requests time out
    # (both nodes at once: neither waits on the other's timeouts).
    results, threads = _load_on(cut, url)
    for t in threads:
        t.join(BOUND + 10)
        assert not t.is_alive()
    for r in results:
        assert_newest_or_typed(r, obj_whole)
    lab.heal()
    writes = Writes(lab, mine)  # from the heal on
    persisted_everywhere(lab, [cut[0]], mine)
    for n in lab.nodes:
        assert_same(obj_cut, load(n, mine))
    assert writes.settle() == 1


def test_link_throttled_to_a_trickle_mid_transfer(lab: Lab, url: str) -> None:
    """A peer load whose source's link drops to a trickle mid-transfer and recovers: the load
    finishes with the right bytes; the object is persisted once."""
    a, b = lab.nodes[0], lab.nodes[1]
    obj = state(11, mib=8)
    assert not isinstance(save(a, obj, url, "persisted"), BaseException)
    writes = Writes(lab, url)  # from the acknowledged persist on
    lab.throttle(a, 20)  # ~3.5 s for 8 MiB
    box: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: box.update(r=load(b, url)))
    loader.start()
    time.sleep(1.0)
    lab.throttle(a, 0.5)  # a trickle: 64 KB/s
    time.sleep(3.0)
    lab.throttle(a, NODE_MBIT)
    loader.join(BOUND + 10)
    assert not loader.is_alive()
    assert not isinstance(box["r"], BaseException), box["r"]
    assert_same(obj, box["r"])
    assert writes.settle() == 1


def test_kill_of_the_saver_loses_no_backed_up_checkpoint(lab: Lab, url: str) -> None:
    """kill -9 of a node right after a ``durability="backup"`` save: the backup node persists
    it once and serves it."""
    a = lab.nodes[0]
    obj = state(12)
    assert not isinstance(save(a, obj, url, "backup"), BaseException)
    lab.kill(a)
    writes = Writes(lab, url)  # from the kill on
    others = [n for n in lab.nodes if n is not a]
    for n in others:
        assert_same(obj, load(n, url))
    wait_until(lambda: lab.versions(url) >= 1, timeout=BOUND, what="the backup node's persist")
    assert writes.settle() == 1


def stored_steps(lab: Lab, path: str) -> collections.Counter[int]:
    """How many times each generation (its ``step``) was written to ``path``: every version
    the bucket keeps, read back."""
    from tests.lab import BUCKET

    key = lab.key_of(path)

    def read_all(s3: Any) -> list[bytes]:
        out = s3.list_object_versions(Bucket=BUCKET, Prefix=key)
        ids = [v["VersionId"] for v in out.get("Versions", []) if v["Key"] == key]
        return [s3.get_object(Bucket=BUCKET, Key=key, VersionId=i)["Body"].read() for i in ids]

    steps = (torch.load(io.BytesIO(b), weights_only=True)["step"] for b in lab.s3(read_all))
    return collections.Counter(steps)


def test_packet_loss_on_the_savers_link(lab: Lab, url: str) -> None:
    """A tenth of the saver's packets are lost both ways while it saves with a backup, its
    group persists, and another node loads across its link: every step ends with the right
    bytes or a typed error within the bound; storage gets the object once."""
    a, b = lab.nodes[0], lab.nodes[1]
    lab.lose(a, LOSS)
    obj = state(13, mib=8)
    result = save(a, obj, url, "backup")
    if isinstance(result, BaseException):
        assert isinstance(result, CkptCacheError), repr(result)
    assert_newest_or_typed(load(b, url), obj)  # from a (across the lossy link) or storage
    assert_newest_or_typed(load(a, url), obj)
    lab.heal(a)
    writes = Writes(lab, url)  # from the heal on
    persisted_everywhere(lab, [a], url)
    for n in lab.nodes:
        assert_same(obj, load(n, url))
    assert writes.settle() == 1
    assert_same(obj, stored_object(lab, url))


def test_coordinator_refusing_the_representative_as_it_finishes(lab: Lab, url: str) -> None:
    """etcd refuses the representative (TCP resets) just before its upload completes: the
    fence, unable to read the writer record, trusts the lease's remaining time, so the upload
    may land. The standby that takes the role once the lease lapses must not write it a
    second time; every node loads it, and storage holds it once."""
    a = lab.nodes[0]
    lab.throttle_storage(16)  # the upload takes seconds
    obj = state(14, mib=3 * PART_MIB)
    assert not isinstance(save(a, obj, url, "backup"), BaseException)
    rep = _representative(lab, url)
    writes = Writes(lab, url)  # from the fault on
    lab.refuse_coordinator(rep)
    lab.throttle_storage(STORAGE_MBIT)  # the rest of the upload lands in well under a lease
    started = time.monotonic()
    assert isinstance(load(rep, url), CoordinatorUnavailable)  # said at once, not timed out
    assert time.monotonic() - started < TTL + 5
    others = [n for n in lab.nodes if n is not rep]
    wait_until(lambda: lab.versions(url) >= 1, timeout=BOUND, what="a write of the group")
    for n in others:
        assert_same(obj, load(n, url))
    time.sleep(2 * TTL)  # the representative's lease is gone: a standby holds the role
    lab.heal(rep)
    wait_until(lambda: info(rep, url).persist_state == "persisted", timeout=BOUND,
               what="the representative learning the group's write")  # fmt: skip
    assert_same(obj, load(rep, url))
    assert writes.settle(quiet=4 * TTL) == 1
    assert stored_steps(lab, url) == {14: 1}


def test_storage_cut_from_the_representative(lab: Lab, url: str) -> None:
    """Storage is unreachable from the representative (etcd is not) mid-upload for longer
    than a lease: the persist completes once, by a standby or after the heal; nothing is
    lost, and every node loads the object meanwhile and after."""
    a = lab.nodes[0]
    lab.throttle_storage(16)
    obj = state(15, mib=3 * PART_MIB)
    assert not isinstance(save(a, obj, url, "backup"), BaseException)
    rep = _representative(lab, url)
    lab.partition(rep, peers=["s3"])
    lab.throttle_storage(STORAGE_MBIT)
    writes = Writes(lab, url)  # from the fault on
    time.sleep(2 * TTL)  # past a lease: etcd still renews the representative's
    for n in lab.nodes:  # memory holds it: the newest, from a peer or its own copy
        assert_same(obj, load(n, url))
    lab.heal(rep)
    holders = [a, *[n for n in lab.nodes if n.node_id in info(a, url).replicas]]
    persisted_everywhere(lab, holders, url)
    assert_same(obj, stored_object(lab, url))
    assert writes.settle(quiet=4 * TTL) == 1
    assert stored_steps(lab, url) == {15: 1}


def test_kill_of_the_saver_while_its_backup_node_is_partitioned(lab: Lab, url: str) -> None:
    """Two faults at once: the node holding a backup copy is partitioned, then the saver is
    killed (kill -9) before its persist lands. No reachable tier has the newest: loads
    elsewhere say so (typed) within the bound; after the heal the backup node persists it
    once, every node loads it, and the killed node, restarted, loads it and saves again."""
    a = lab.nodes[0]
    lab.throttle_storage(2)  # the persist cannot land before the kill
    obj = state(16)
    assert not isinstance(save(a, obj, url, "backup"), BaseException)
    backup = next(n for n in lab.nodes if n.node_id in info(a, url).replicas)
    lab.partition(backup)
    lab.kill(a)
    lab.throttle_storage(STORAGE_MBIT)
    writes = Writes(lab, url)  # from the kill on
    others = [n for n in lab.nodes if n not in (a, backup)]
    results, threads = _load_on(others, url)
    for t in threads:
        t.join(BOUND + 10)
        assert not t.is_alive()
    for r in results:
        assert_newest_or_typed(r, obj)
    assert lab.versions(url) == 0  # nobody reachable held it
    lab.heal(backup)
    wait_until(lambda: lab.versions(url) >= 1, timeout=BOUND, what="the backup node's persist")
    for n in [*others, backup]:
        assert_same(obj, load(n, url))
    lab.restart(a)
    lab.wait_formed()
    assert_same(obj, load(a, url))
    newer = state(17)
    assert not isinstance(save(a, newer, url, "persisted"), BaseException)
    for n in lab.nodes:
        assert_same(newer, load(n, url))
    assert writes.settle() == 2
    assert stored_steps(lab, url) == {16: 1, 17: 1}


def test_successive_saves_from_different_nodes_across_a_partition(lab: Lab, url: str) -> None:
    """One path saved again from node to node (a job's rank 0 coming back elsewhere), a
    partition in between: storage holds the newest after each save, and every node's next
    load returns it, never the copy it kept of an older one; a node cut off says so."""
    a, b, c, _ = lab.nodes
    first, second, third = state(21), state(22), state(23)
    assert not isinstance(save(a, first, url, "persisted"), BaseException)
    for n in lab.nodes:  # every node holds the first now
        assert_same(first, load(n, url))
    lab.partition(c)
    assert not isinstance(save(b, second, url, "persisted"), BaseException)
    assert_same(second, stored_object(lab, url))
    for n in lab.nodes:
        if n is not c:
            assert_same(second, load(n, url))
    assert_newest_or_typed(load(c, url), second)  # cut off: typed, never the first
    lab.heal(c)
    assert_same(second, load(c, url))
    assert not isinstance(save(c, third, url, "persisted"), BaseException)
    assert_same(third, stored_object(lab, url))
    for n in lab.nodes:
        assert_same(third, load(n, url))
    assert stored_steps(lab, url) == {21: 1, 22: 1, 23: 1}  # each generation written once
