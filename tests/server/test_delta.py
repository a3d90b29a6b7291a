"""What a push leaves out when its receiver holds storages already (``server/cluster/delta``):
the ranges sent cover every byte outside the held storages exactly once, in order; matches
come only from the same user's generations; a source whose bytes changed fails the placing
with the tensor named; and every source is unpinned, whatever happened."""

from __future__ import annotations

import os
import random

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import compute_digests
from ckptcache.server.cluster import delta
from ckptcache.wire import messages as m
from ckptcache.wire import peer
from tests.server.conftest import NS, digested


def _body(plan) -> int:
    return plan.layout.nbytes - HEADER_SIZE - 8 * len(plan.manifest.storages)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"base.{i}": torch.randn(1 << 16, generator=g) for i in range(6)}  # 256 KiB each
    g = torch.Generator().manual_seed(seed)
    out.update({f"lora.{i}": torch.randn(1 << 10, generator=g) for i in range(3)})
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_gaps_cover_every_byte_outside_the_held_storages_once(seed):
    rng = random.Random(seed)
    obj = {f"t{i}": torch.zeros(rng.randrange(0, 5000)) for i in range(rng.randrange(1, 12))}
    plan = plan_object(flatten(obj), "/x.pt", NS)
    storages = plan.manifest.storages
    have = sorted(rng.sample(range(len(storages)), rng.randrange(0, len(storages) + 1)))
    body = _body(plan)
    covered = [0] * body
    for lo, hi in delta.gaps(plan.manifest, body, have):
        assert 0 <= lo < hi <= body
        for k in range(lo, hi):
            covered[k] += 1
    for i in have:
        lo = storages[i].offset - HEADER_SIZE
        for k in range(lo, lo + storages[i].nbytes):
            covered[k] += 1
    assert covered == [1] * body
    with pytest.raises(ValueError, match="out of range"):
        delta.gaps(plan.manifest, body, [len(storages)])


def test_an_ack_naming_held_storages_is_checked():
    assert peer.Ack(have=(0, 3)).have == (0, 3)
    for bad in ((3, 0), (1, 1), (-1,)):
        with pytest.raises(ValueError, match=r"Ack\.have"):
            peer.Ack(have=bad)
    with pytest.raises(ValueError, match="one connection"):
        peer.Ack(stripes=(0, 100), have=(0,))


def _planned(obj, path):
    """The plan, the segment bytes and the digests of ``obj`` saved at ``path``."""
    flat = flatten(obj)
    plan = plan_object(flat, path, NS)
    buf = bytearray(plan.layout.nbytes)
    write_object(memoryview(buf), plan, flat)
    return plan, buf, compute_digests(memoryview(buf), plan.manifest)


def _held_core(make_core):
    """A core holding ``_state(1)``, digested: the source of the tests' matches."""
    core = make_core(pool_bytes=0)
    session = core.saves.open_session(1, os.getuid())
    path = "/tmp/delta/one.pt"
    plan, buf, _ = _planned(_state(1), path)
    reply = core.saves.reserve(session, m.ReserveRequest(NS, path, plan.layout.nbytes, "local"))
    core.state.arena.segments[reply.segment].mapping[: len(buf)] = bytes(buf)
    core.saves.commit(session, m.CommitRequest(reply.reservation, plan.layout.manifest_offset,
                                               len(plan.manifest_bytes)))  # fmt: skip
    gen = core.state.index.newest((NS, path))
    digested(gen)
    return core, gen


def _offer(obj):
    return _planned(obj, "/tmp/delta/two.pt")


def test_the_held_storages_are_the_unchanged_ones_and_land_equal(make_core):
    core, source = _held_core(make_core)
    plan, buf, digests = _offer(_state(2))
    found = delta.find_held(core.state, NS, -1, plan.manifest, digests, _body(plan))
    assert found is not None and source.pins == 1
    names = [plan.manifest.storages[i].name for i in found.have]
    assert sorted(names) == [f"base.{i}" for i in range(6)]  # the adapters changed
    view = bytearray(len(buf) - HEADER_SIZE)
    with found.pinned_until_done():
        delta.place(memoryview(view), found, plan.manifest, digests)
    assert source.pins == 0
    for i in found.have:
        r = plan.manifest.storages[i]
        lo = r.offset - HEADER_SIZE
        assert view[lo : lo + r.nbytes] == buf[r.offset : r.offset + r.nbytes]
    # Another user's generations are never sources.
    assert delta.find_held(core.state, NS, os.getuid() + 4242, plan.manifest, digests,
                           _body(plan)) is None  # fmt: skip
    assert source.pins == 0


def test_a_source_changed_since_it_was_digested_is_named_and_unpinned(make_core):
    core, source = _held_core(make_core)
    plan, buf, digests = _offer(_state(2))
    found = delta.find_held(core.state, NS, -1, plan.manifest, digests, _body(plan))
    assert found is not None
    i, src, offset = found.picks[2]
    src.segment.mapping[offset + 100] ^= 0xFF  # its memory went bad after the digest
    view = bytearray(len(buf) - HEADER_SIZE)
    name = plan.manifest.storages[i].name
    with pytest.raises(CorruptCheckpoint, match=name) as err, found.pinned_until_done():
        delta.place(memoryview(view), found, plan.manifest, digests)
    assert err.value.tensor == name
    assert source.pins == 0


def test_too_little_held_sends_the_whole_copy(make_core):
    core, source = _held_core(make_core)
    changed = {k: v + 1 if k.startswith("base") and k != "base.0" else v
               for k, v in _state(2).items()}  # fmt: skip
    plan, _buf, digests = _offer(changed)  # one base tensor of six held: under the share
    assert delta.find_held(core.state, NS, -1, plan.manifest, digests, _body(plan)) is None
    assert source.pins == 0


@pytest.mark.parametrize("seed", range(10))
def test_the_ranges_travel_in_order_small_ones_gathered(seed):
    rng = random.Random(seed)
    spans, pos = [], 0
    for _ in range(rng.randrange(0, 60)):
        lo = pos + rng.randrange(1, 1 << 20)
        pos = lo + rng.choice((rng.randrange(1, 200), rng.randrange(1, 3 << 20)))
        spans.append((lo, pos))
    out = delta.batches(spans)
    assert [s for batch in out for s in batch] == spans
    for batch in out:
        sizes = [hi - lo for lo, hi in batch]
        if any(size >= delta.GATHER for size in sizes):
            assert len(batch) == 1  # a large range travels alone
        else:
            assert sum(sizes) < 2 * delta.GATHER


@pytest.mark.parametrize("seed", range(10))
def test_the_storages_within_a_range_are_the_landing_windows_ones(seed):
    from ckptcache.server.cluster.landing import LandingDigests

    rng = random.Random(seed)
    obj = {f"t{i}": torch.zeros(rng.randrange(0, 3000)) for i in range(rng.randrange(1, 30))}
    plan = plan_object(flatten(obj), "/x.pt", NS)
    body = _body(plan)
    within = delta.Within(plan.manifest)
    for _ in range(20):
        lo = rng.randrange(0, body)
        hi = rng.randrange(lo + 1, body + 1)
        want = [(i, lo + a, lo + b) for i, a, b in LandingDigests(plan.manifest, lo, hi).spans_of]
        assert sorted(within(lo, hi)) == sorted(want)
