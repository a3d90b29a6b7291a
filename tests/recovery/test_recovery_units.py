"""Single-process tests of the recovery building blocks (no process group needed)."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ckptcache.errors import CkptCacheError
from ckptcache.recovery import (
    HostSnapshot,
    PeerRecovery,
    RecoveryError,
    StepGuard,
    capture_rng,
    restore_rng,
    training_state_dict,
)
from ckptcache.recovery._buckets import (
    BufferPool,
    allocate_flat,
    flat_view,
    pack,
    plan_buckets,
    unpack,
)
from ckptcache.recovery._digests import buffer_word, fold_words, state_digests
from ckptcache.recovery._feasibility import (
    PROTOCOL_VERSION,
    Announcement,
    TransferCheck,
    decide,
    to_i64,
    transfer_problem,
)
from ckptcache.recovery._state import TensorSpec, flatten, rebuild, training_state
from tests.helpers import thread_inside, wait_until

# ----------------------------------------------------------------------------- buckets


def _spec(i: int, numel: int, dtype: torch.dtype = torch.float32) -> TensorSpec:
    return TensorSpec(("t", i), dtype, (numel,), "cpu")


def test_small_tensors_are_packed_and_large_ones_chunked() -> None:
    specs = [_spec(0, 10), _spec(1, 10), _spec(2, 100), _spec(3, 5, torch.int64)]
    buckets = plan_buckets(specs, bucket_bytes=25 * 4)  # 25 float32 elements per bucket
    f32 = [b for b in buckets if b.dtype == torch.float32]
    # Tensor 2 is cut into four chunks aligned to its start; tensors 0 and 1 share a bucket.
    assert [tuple(s.tensor for s in b.segments) for b in f32] == [(2,), (2,), (2,), (2,), (0, 1)]
    assert [b.segments[0].start for b in f32[:4]] == [0, 25, 50, 75]
    assert all(b.numel * 4 <= 100 for b in f32)
    assert [b.dtype for b in buckets].count(torch.int64) == 1


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    bucket_bytes=st.integers(4, 2000),
    double=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_pack_unpack_round_trip(sizes: list[int], bucket_bytes: int, double: list[bool]) -> None:
    dtypes = [torch.float64 if double[i] else torch.float32 for i in range(len(sizes))]
    src = [torch.randn(n, dtype=d) for n, d in zip(sizes, dtypes, strict=True)]
    dst = [torch.zeros_like(t) for t in src]
    specs = [TensorSpec(("t", i), t.dtype, tuple(t.shape), "cpu") for i, t in enumerate(src)]
    pool = BufferPool(torch.device("cpu"))
    for bucket in plan_buckets(specs, bucket_bytes):
        assert bucket.numel * src[bucket.segments[0].tensor].element_size() <= max(bucket_bytes, 8)
        buf = pool.take(bucket.dtype, bucket.numel)
        pack(bucket, src, buf)
        unpack(bucket, buf.clone(), dst)  # the clone stands in for the wire
        pool.give(buf)
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))


def test_unpack_into_non_contiguous_destination() -> None:
    src = [torch.arange(12.0).view(3, 4)]
    dst = [torch.zeros(4, 3).t()]  # transposed: not contiguous
    specs = [TensorSpec(("t", 0), torch.float32, (3, 4), "cpu")]
    (bucket,) = plan_buckets(specs, 1024)
    buf = torch.empty(bucket.numel)
    pack(bucket, src, buf)
    unpack(bucket, buf, dst)
    assert torch.equal(dst[0], src[0])


def test_large_tensors_go_alone_and_model_tensors_are_packed_apart() -> None:
    specs = [
        TensorSpec(("model", "a"), torch.float32, (4,), "cpu"),
        TensorSpec(("model", "big"), torch.float32, (64,), "cpu"),
        TensorSpec(("optimizer", "state", 0, "exp_avg"), torch.float32, (4,), "cpu"),
        TensorSpec(("model", "b"), torch.float32, (4,), "cpu"),
        TensorSpec(("optimizer", "state", 0, "step"), torch.float32, (), "cpu"),
    ]
    buckets = plan_buckets(specs, bucket_bytes=1024, direct_bytes=64)
    assert [tuple(s.tensor for s in b.segments) for b in buckets] == [(1,), (0, 3), (2, 4)]


def test_new_tensors_of_a_bucket_are_received_in_place() -> None:
    specs = [
        TensorSpec(("optimizer", "m", i), torch.float32, shape, "cpu")
        for i, shape in enumerate([(3,), (2, 2), ()])
    ]
    (bucket,) = plan_buckets(specs, bucket_bytes=1024)
    made = allocate_flat(bucket, specs, torch.device("cpu"))
    assert made is not None
    tensors = [made[i] for i in range(3)]
    assert [tuple(t.shape) for t in tensors] == [(3,), (2, 2), ()]
    flat = flat_view(bucket, tensors, torch.device("cpu"))
    assert flat is not None and flat.numel() == 8
    flat.copy_(torch.arange(8.0))  # what the broadcast does
    assert torch.equal(tensors[1], torch.tensor([[3.0, 4.0], [5.0, 6.0]]))
    assert tensors[2].item() == 7.0
    # Separate tensors (the source's, or a receiver's own) need packing.
    assert flat_view(bucket, [t.clone() for t in tensors], torch.device("cpu")) is None
    # A chunk of a large tensor is not allocated as a view: the tensor is made whole.
    chunked = plan_buckets([specs[0]], bucket_bytes=8)
    assert allocate_flat(chunked[0], specs, torch.device("cpu")) is None


@pytest.mark.parametrize("mode", ["checksum", "xxh3"])
def test_bucket_words_detect_a_flip_and_their_order(mode: str) -> None:
    buf = torch.randn(1001)
    word = buffer_word(buf, mode)  # type: ignore[arg-type]
    flipped = buf.clone()
    flipped.view(torch.uint8)[1234] ^= 4
    assert buffer_word(flipped, mode) != word  # type: ignore[arg-type]
    assert buffer_word(buf[1:], mode) == buffer_word(buf[1:].clone(), mode)  # type: ignore[arg-type]
    assert fold_words([1, 2]) != fold_words([2, 1]) != fold_words([1, 2, 0])


def _check(role: int, digest: int, unsent: int = 0) -> TransferCheck:
    return TransferCheck(role, digest, unsent)


@pytest.mark.parametrize(
    ("checks", "reason"),
    [
        ([_check(1, 5), _check(2, 5), _check(3, 5)], None),
        ([_check(1, 5), _check(2, 6)], "rank 1 received state whose digest does not match"),
        ([_check(1, 5, 1), _check(2, 5, 2)], "rank 1 skipped frozen weights"),
        ([_check(1, 5), _check(3, 6), _check(2, 5)], "state digests differ among healthy"),
        ([_check(1, 5), _check(4, 0), _check(2, 5)], "rank 1: missing tensors"),
        ([_check(2, 5), _check(2, 5)], "no rank reported sending the state"),
    ],
)
def test_transfer_problem(checks: list[TransferCheck], reason: str | None) -> None:
    got = transfer_problem(checks, list(range(len(checks))))
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got
    assert TransferCheck.from_tensor(checks[0].to_tensor(torch.device("cpu"))) == checks[0]


# ----------------------------------------------------------------------------- state


def test_flatten_rebuild_keeps_nested_containers() -> None:
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    state = {
        "x": torch.ones(2),
        "od": OrderedDict(w=torch.zeros(3)),
        "lst": [1, (torch.arange(3), "s"), Pair(torch.ones(1), 5)],
        "plain": {"lr": 0.1},
    }
    flat = flatten(state)
    assert len(flat.tensors) == 4
    assert {s.path for s in flat.specs} >= {("x",), ("od", "w"), ("lst", 1, 0), ("lst", 2, 0)}
    back = rebuild(flat.skeleton, list(flat.tensors))
    assert isinstance(back["od"], OrderedDict)
    assert isinstance(back["lst"][2], Pair) and back["lst"][2].b == 5
    assert back["lst"][1][1] == "s" and back["plain"] == {"lr": 0.1}
    assert torch.equal(back["lst"][1][0], torch.arange(3))


# ----------------------------------------------------------------------------- digests


def _model_state() -> tuple[list[TensorSpec], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7))
    flat = flatten(training_state(model, None))
    return list(flat.specs), [t.clone() for t in flat.tensors]


@pytest.mark.parametrize("mode", ["checksum", "xxh3"])
def test_digest_detects_a_single_bit_flip(mode: str) -> None:
    specs, tensors = _model_state()
    before = state_digests(specs, tensors, mode)  # type: ignore[arg-type]
    assert before == state_digests(specs, [t.clone() for t in tensors], mode)  # type: ignore[arg-type]
    raw = tensors[0].view(-1).view(torch.int32)
    raw[3] ^= 1 << 17
    assert state_digests(specs, tensors, mode)[0] != before[0]  # type: ignore[arg-type]


def test_digest_ignores_dict_order_and_splits_frozen() -> None:
    specs, tensors = _model_state()
    digest = state_digests(specs, tensors, "checksum")
    assert state_digests(specs[::-1], tensors[::-1], "checksum") == digest
    frozen = [
        TensorSpec(s.path, s.dtype, s.shape, s.device_type, i == 0) for i, s in enumerate(specs)
    ]
    live, frozen_digest = state_digests(frozen, tensors, "checksum")
    tensors[0].add_(1.0)  # changing a frozen tensor leaves the live digest alone
    assert state_digests(frozen, tensors, "checksum")[0] == live
    assert state_digests(frozen, tensors, "checksum")[1] != frozen_digest


# ----------------------------------------------------------------------------- feasibility


def _ann(recovering: int = 0, step: int = 5, digest: int = 11, **kw: int) -> Announcement:
    fields = dict(
        version=PROTOCOL_VERSION,
        recovering=recovering,
        step=-1 if recovering else step,
        in_flight=-1,
        fingerprint=42,
        arguments=3,
        digest=0 if recovering else digest,
        frozen_digest=0,
        snapshot_step=-1,
        snapshot_digest=0,
        snapshot_frozen_digest=0,
        has_frozen=0,
    )
    fields.update(kw)
    return Announcement(**fields)


def test_decide_picks_lowest_healthy_rank_as_source() -> None:
    f = decide([_ann(recovering=1), _ann(), _ann()], [4, 5, 6], verify_digests=True)
    assert f.ok and f.source_rank == 5 and f.step == 5 and f.receivers == (4,)
    assert f.source_kind == "live" and f.healthy_ranks == (5, 6)


@pytest.mark.parametrize(
    ("anns", "reason"),
    [
        (
            [_ann(step=5), _ann(step=6), _ann(recovering=1)],
            "disagree on the global step (rank 0: 5, rank 1: 6)",
        ),
        ([_ann(recovering=1), _ann(recovering=1, in_flight=7)], "no healthy replica"),
        (
            [_ann(digest=1), _ann(digest=2), _ann(recovering=1)],
            "state digests differ among healthy",
        ),
        ([_ann(), _ann(fingerprint=9)], "model structure differs"),
        ([_ann(), _ann(arguments=1)], "ranks passed different state"),
        ([_ann(), _ann(version=PROTOCOL_VERSION + 1)], "different recovery protocol versions"),
        ([_ann(step=-1), _ann(recovering=1)], "did not say which step"),
    ],
)
def test_decide_refuses_with_reason(anns: list[Announcement], reason: str) -> None:
    f = decide(anns, list(range(len(anns))), verify_digests=True)
    assert not f and reason in f.reason


def test_decide_no_healthy_mentions_interrupted_step() -> None:
    f = decide([_ann(recovering=1), _ann(recovering=1, in_flight=7)], [0, 1], verify_digests=True)
    assert "interrupted mid optimizer step: rank 1: 7" in f.reason


def test_decide_digest_mismatch_ignored_when_not_verifying() -> None:
    anns = [_ann(digest=1), _ann(digest=2), _ann(recovering=1)]
    assert decide(anns, [0, 1, 2], verify_digests=False).ok


def test_decide_falls_back_to_newest_snapshot() -> None:
    anns = [
        _ann(recovering=1, snapshot_step=3, snapshot_digest=to_i64(2**64 - 1)),
        _ann(recovering=1, snapshot_step=4, snapshot_digest=8),
        _ann(recovering=1, snapshot_step=4, snapshot_digest=8),
    ]
    f = decide(anns, [0, 1, 2], verify_digests=True)
    assert f.ok and f.source_kind == "snapshot" and f.step == 4 and f.source_rank == 1
    assert f.receivers == (0, 2)


def test_decide_skips_frozen_only_if_every_receiver_has_them() -> None:
    base = [_ann(), _ann(recovering=1, has_frozen=1)]
    assert not decide(base, [0, 1], verify_digests=True).send_frozen
    both = [*base, _ann(recovering=1, has_frozen=0)]
    assert decide(both, [0, 1, 2], verify_digests=True).send_frozen


def test_announcement_tensor_round_trip() -> None:
    a = _ann(digest=to_i64(2**64 - 5))
    assert Announcement.from_tensor(a.to_tensor(torch.device("cpu"))) == a


# ----------------------------------------------------------------------------- guard and rng


def test_guard_commits_and_keeps_interrupted_step_in_flight() -> None:
    guard = StepGuard(step=3)
    with guard.optimizer_step(3):
        assert guard.in_flight == 3
    assert guard.committed_step == 4 and guard.in_flight is None
    with pytest.raises(ValueError), guard.optimizer_step():
        raise ValueError("crash mid-step")
    assert guard.in_flight == 4 and guard.committed_step == 4
    with pytest.raises(RuntimeError, match="interrupted"):
        guard.rewind()
    guard.reset(4)
    assert guard.in_flight is None


def test_paused_waits_for_the_step_in_flight() -> None:
    guard = StepGuard()
    inside, order = threading.Event(), []

    def fault_handler() -> None:
        inside.wait()
        with guard.paused() as committed:
            order.append(("handler", committed))

    t = threading.Thread(target=fault_handler)
    t.start()
    with guard.optimizer_step(0):
        inside.set()
        # The handler is blocked entering paused() while this step is in flight.
        wait_until(lambda: thread_inside(t, "paused"), 10, "the handler to wait in paused()")
        order.append(("step", 0))
    t.join(timeout=10)
    assert order == [("step", 0), ("handler", 1)]


def test_guard_rewinds_batchnorm_statistics_and_rng() -> None:
    model = nn.BatchNorm1d(3)
    guard = StepGuard(model)
    before = model.running_mean.clone()
    expected = torch.rand(2)
    model(torch.randn(4, 3))  # forward of a step that then fails
    torch.rand(5)
    guard.rewind()
    assert torch.equal(model.running_mean, before)
    assert torch.equal(torch.rand(2), expected)


def test_rng_capture_restore_all_generators() -> None:
    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


# ----------------------------------------------------------------------------- snapshot


def _trained_adam(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    return model, opt


def test_host_snapshot_restores_into_fresh_objects_without_aliasing() -> None:
    model, opt = _trained_adam(0)
    snap = HostSnapshot(every=2)
    assert not snap.maybe_capture(model, opt, step=3)
    assert snap.maybe_capture(model, opt, step=4, extra_state={"pos": torch.tensor([7])})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = nn.Linear(4, 3), None
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    extra = snap.restore(fresh, fresh_opt)
    assert torch.equal(extra["pos"], torch.tensor([7]))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    exp_avg = fresh_opt.state[fresh.weight]["exp_avg"]
    digest = snap.digests("checksum")
    exp_avg.add_(1.0)  # training on must not write through to the snapshot
    snap._digests.clear()
    assert snap.digests("checksum") == digest and snap.step == 4


# ----------------------------------------------------------------------------- no process group


def test_without_process_group_falls_back_or_raises() -> None:
    model, opt = _trained_adam(0)
    saved = {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in training_state_dict(model, opt, step=9).items()
    }
    fresh, fresh_opt = _trained_adam(1)
    guard = StepGuard(fresh)
    recovery = PeerRecovery(guard=guard)
    assert not recovery.is_feasible(fresh, fresh_opt, recovering=True)
    result = recovery.recover(fresh, fresh_opt, recovering=True, fallback=lambda: saved)
    assert result.source == "fallback" and not result.recovered
    assert "torch.distributed is not initialised" in result.reason
    assert result.step == 9 and guard.committed_step == 9
    assert torch.equal(fresh.weight, model.weight)
    with pytest.raises(RecoveryError) as info:
        recovery.recover(fresh, fresh_opt, recovering=True)
    assert isinstance(info.value, CkptCacheError) and isinstance(info.value, RuntimeError)
    assert "not initialised" in info.value.reason
