"""A backup push sends only what the backup node does not hold already: two real daemons on a
real etcd. A LoRA-shaped state saved twice with ``durability="backup"``: the second push
sends the adapters and the archive's metadata, the backup node copies the frozen base from
its copy of the first save, and a load from it returns the second save's bytes. A held
storage damaged on the backup node fails that push, which is then sent whole."""

from __future__ import annotations

from typing import Any

import torch

from ckptcache.errors import CkptCacheError
from tests.e2e.local.test_corrupt import flip_bytes_of, wait_digested
from tests.helpers import assert_same, metric, wait_until

BASE = 8  # frozen tensors of 1 MiB


def lora(seed: int) -> dict[str, Any]:
    """A frozen base (the same for every seed) and small adapters (new for each)."""
    g = torch.Generator().manual_seed(0)
    base = {f"base.{i}": torch.randn(1 << 18, generator=g) for i in range(BASE)}
    g = torch.Generator().manual_seed(seed)
    adapters = {f"lora.{i}": torch.randn(1 << 15, generator=g) for i in range(4)}
    return {"model": {**base, **adapters}, "step": seed}


def held(d: Any, what: str = "push") -> float:
    """The node's ``ckptcache_push_bytes_held`` (or ``fetch_``) counter."""
    value = metric(d, f"ckptcache_{what}_bytes_held_total")
    assert value is not None, f"no {what}_bytes_held counter in the metrics"
    return value


def _nodes(cluster_factory: Any, tmp_path: Any, config: str = "") -> list[Any]:
    root = tmp_path / "store"
    root.mkdir()
    return cluster_factory(2, "--persist-root", str(root), "--metrics-port", "0",
                           "--log-level", "DEBUG", config=config)  # fmt: skip


def test_a_push_sends_only_what_the_backup_node_lacks(cluster_factory, tmp_path):
    a, b = _nodes(cluster_factory, tmp_path)
    first, second = str(tmp_path / "store/step-1.pt"), str(tmp_path / "store/step-2.pt")
    with a.client() as c:
        c.save(lora(1), first, durability="backup")
        assert held(a) == 0  # nothing of it was on the backup node
        c.save(lora(2), second, durability="backup")
        assert held(a) == BASE << 20  # the frozen base, byte for byte
        assert "8 storages held here" in b.log()
        c.delete(second)  # local: the load now comes from the backup node
        assert_same(lora(2), c.load(second))
        assert c.status(second).last_load_tier == "peer"
    with b.client() as cb:
        assert cb.verify(second).ok  # its copy against its digest table
        assert_same(lora(2), cb.load(second))


def test_a_fetch_takes_only_what_the_loading_node_lacks(cluster_factory, tmp_path):
    """The origin dropped its copy of the second save but holds the first: the load fetches
    the second from the backup node less the frozen base, which it copies from its own."""
    a, b = _nodes(cluster_factory, tmp_path)
    assert "storages held here" not in b.log()
    first, second = str(tmp_path / "store/step-1.pt"), str(tmp_path / "store/step-2.pt")
    with a.client() as c:
        c.save(lora(1), first, durability="backup")
        c.save(lora(2), second, durability="backup")
        c.delete(second)
        assert held(a, "fetch") == 0
        assert_same(lora(2), c.load(second, verify=True))
        assert c.status(second).last_load_tier == "peer"
        assert held(a, "fetch") == BASE << 20
        assert "8 storages held here" in a.log()
        assert c.verify(second).ok
        assert_same(lora(1), c.load(first))


def test_a_fetch_of_what_the_loading_node_holds_none_of_comes_in_stripes(cluster_factory, tmp_path):
    """The loading node holds other saves (so it asks for the digests), but none of this
    one's storages: the body comes whole, in the stripes the holder planned, as a fetch that
    asked for no digests would."""
    a, _ = _nodes(cluster_factory, tmp_path, config="data_plane_streams: 4\n")
    first, other = str(tmp_path / "mem/step-1.pt"), str(tmp_path / "mem/other.pt")
    g = torch.Generator().manual_seed(5)
    big = {"w": torch.randn(16 << 20, generator=g)}  # 64 MiB: four stripes of 16 MiB
    with a.client() as c:
        c.save(lora(1), first, durability="backup")
        c.save(big, other, durability="backup")
        c.delete(other)  # local: the load fetches it from b
        assert_same(big, c.load(other, verify=True))
        assert c.status(other).last_load_tier == "peer"
        assert held(a, "fetch") == 0
        assert f"receiving {other} from node1 in 4 stripes" in a.log()
        assert_same(lora(1), c.load(first))


def test_a_fetch_of_a_copy_without_tensors_by_a_node_that_holds_others(cluster_factory, tmp_path):
    """A copy without storages has no digest table to answer: it comes as a plain fetch (the
    loading node asked for the digests and waited for none, the holder for its answer)."""
    a, _ = _nodes(cluster_factory, tmp_path)
    first, other = str(tmp_path / "mem/step-1.pt"), str(tmp_path / "mem/meta.pt")
    meta = {"step": 3, "name": "run-7"}
    with a.client() as c:
        c.save(lora(1), first, durability="backup")
        wait_digested(c, first)  # the loading node may hold storages: it asks for digests
        c.save(meta, other, durability="backup")
        c.delete(other)
        assert c.load(other) == meta
        assert c.status(other).last_load_tier == "peer"


def test_a_storage_damaged_in_the_loading_nodes_memory_is_not_the_holders_fault(
    cluster_factory, tmp_path
):
    """The fetch less what the loading node holds takes a storage that is damaged in that
    node's own older save: that save is dropped there, the fetch is taken again whole, and
    the node that served it keeps its copy (it was never at fault). (Pages not shared: the
    damage lies in the older save's own memory, never read back from the newer's.)"""
    a, b = _nodes(cluster_factory, tmp_path, config="share_pages: false\n")
    # Memory-only saves: a persist that ended would take the older save out of a's memory.
    first, second = str(tmp_path / "mem/step-1.pt"), str(tmp_path / "mem/step-2.pt")
    with a.client() as c, b.client() as cb:
        c.save(lora(1), first, durability="backup")
        c.save(lora(2), second, durability="backup")
        wait_digested(c, first)
        wait_until(lambda: cb.status(second).digests_valid, what="b's copy digested")
        flip_bytes_of(a, c, first, tensor_index=0)  # base.0 of a's own older save
        c.delete(second)
        assert_same(lora(2), c.load(second, verify=True))
        assert c.status(second).last_load_tier == "peer"
        assert "fetching all of it" in a.log()
        assert first not in [o.path for o in c.list()]  # dropped from a's memory
        assert cb.verify(second).ok  # b's copy kept, and sound
        assert "corrupt copy of" not in b.log()


def test_a_held_storage_damaged_on_the_backup_node_sends_the_push_whole(cluster_factory, tmp_path):
    a, b = _nodes(cluster_factory, tmp_path)
    first, second = str(tmp_path / "store/step-1.pt"), str(tmp_path / "store/step-2.pt")
    with a.client() as c, b.client() as cb:
        c.save(lora(1), first, durability="backup")
        # The next push is offered less what b holds once a knows b holds a copy of it.
        wait_until(lambda: c.status(first).replicas, what="the backup copy recorded")
        flip_bytes_of(b, cb, first, tensor_index=0)  # base.0 of the backup node's copy
        c.save(lora(2), second, durability="backup")
        assert held(a) == 0  # the push less base.0 failed; the whole one succeeded
        assert "failed" in a.log() and "sending all of it" in a.log()
        assert cb.verify(second).ok
        c.delete(second)
        assert_same(lora(2), c.load(second))
        assert c.status(second).last_load_tier == "peer"


def test_the_sender_killed_mid_push_leaves_nothing_held_on_the_backup_node(
    cluster_factory, tmp_path
):
    """SIGKILL of the origin while the backup node copies what it holds and takes the rest:
    the sources it read are unpinned and its reservation given back (nothing wedges its
    budget), and it serves a whole save or says typed that the newest is out of reach."""
    a, b = _nodes(cluster_factory, tmp_path)
    first, second = str(tmp_path / "store/step-1.pt"), str(tmp_path / "store/step-2.pt")

    def big(seed: int) -> dict[str, Any]:  # 48 MiB held, 32 MiB new: a push that takes a while
        state = lora(seed)
        frozen, new = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
        state["model"].update({f"frozen.{i}": torch.randn(1 << 22, generator=frozen)
                               for i in range(3)})  # fmt: skip
        state["model"].update({f"new.{i}": torch.randn(1 << 22, generator=new) for i in range(2)})
        return state

    with a.client() as c:
        c.save(big(1), first, durability="backup")
        c.save(big(2), second)  # durability local: the push runs in the background
    wait_until(lambda: "storages held here" in b.log(), timeout=30, interval=0.002,
               what="the push less what the backup node holds")  # fmt: skip
    a.kill()
    wait_until(lambda: b.status().pinned == 0 and b.status().reservations == 0, timeout=30,
               what="the backup node's pins and reservation given back")  # fmt: skip
    with b.client() as cb:
        assert_same(big(1), cb.load(first, verify=True))
        try:
            got = cb.load(second, verify=True)
        except CkptCacheError:
            got = None
        if got is not None:  # the push completed before the kill: the whole of it
            assert_same(big(2), got)
        cb.delete(first)
    wait_until(lambda: b.status().generations == (0 if got is None else 1), timeout=30,
               what="the source generation gone with its delete")  # fmt: skip
