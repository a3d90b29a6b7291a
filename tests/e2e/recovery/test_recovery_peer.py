"""Multi-process checkpointless recovery on gloo/CPU: recovered runs match uninterrupted ones."""

from __future__ import annotations

import pytest
import torch
from _recovery_dist import run_workers
from _recovery_workers import (
    FAULT_STEP,
    apply_fails_on_receiver,
    corrupt_in_flight,
    ddp_recover,
    extra_state_and_dtypes,
    fails_mid_transfer,
    frozen_and_snapshot,
    frozen_twice,
    gpu_recover,
    infeasible,
    mismatched_settings,
    two_shards,
    wipe_and_recover,
)

pytestmark = pytest.mark.timeout(120)

TINY_BUCKETS = 256  # bytes: forces many buckets and chunked tensors on a tiny model


def _assert_matches_reference(out: dict) -> None:
    assert out["model_equal"], "parameters differ from the uninterrupted run"
    assert out["optimizer_equal"], "optimizer state differs from the uninterrupted run"
    assert out["losses_equal"], "losses after recovery differ from the uninterrupted run"
    assert out["state_equal"], "scheduler or extra state differs from the uninterrupted run"


def test_restarted_rank_recovers_from_peer_and_training_matches() -> None:
    outs = run_workers(wipe_and_recover, 2, "restart", (1,), TINY_BUCKETS)
    for rank, out in enumerate(outs):
        assert out["source"] == "peer"
        assert out["step"] == FAULT_STEP
        assert out["role"] == ("receiver" if rank == 1 else "source")
        assert out["recovered_ranks"] == (1,)
        assert out["extra_equal"]
        _assert_matches_reference(out)
    assert outs[0]["nbytes"] == outs[1]["nbytes"] > 0


def test_fault_in_forward_reruns_the_step_with_bystander() -> None:
    # World 3: rank 0 sends, rank 1 receives, rank 2 only relays. Healthy ranks already ran
    # forward/backward (dropout RNG, BatchNorm statistics) and must rewind them.
    outs = run_workers(wipe_and_recover, 3, "forward", (1,), 1 << 20)
    assert [o["role"] for o in outs] == ["source", "receiver", "bystander"]
    for out in outs:
        assert out["source"] == "peer"
        assert out["step"] == FAULT_STEP  # the interrupted step is run again
        _assert_matches_reference(out)


def test_fault_in_optimizer_step_keeps_replicas_consistent() -> None:
    # Rank 1 dies halfway through optimizer.step(): its guard shows the step in flight, so it
    # counts as recovering; rank 0 finished the step and sends the post-step state.
    outs = run_workers(wipe_and_recover, 2, "optimizer", (1,), TINY_BUCKETS)
    for out in outs:
        assert out["source"] == "peer"
        assert out["step"] == FAULT_STEP + 1
        assert out["recovered_ranks"] == (1,)
        _assert_matches_reference(out)


def test_ddp_wrapped_model_recovering_rank_zero() -> None:
    outs = run_workers(ddp_recover, 2)
    assert [o["role"] for o in outs] == ["receiver", "source"]
    for out in outs:
        assert out["source"] == "peer"
        _assert_matches_reference(out)


def test_frozen_weights_skipped_and_snapshot_source() -> None:
    outs = run_workers(frozen_and_snapshot, 2)
    for out in outs:
        for case in ("skip=False", "skip=True", "snapshot"):
            _assert_matches_reference(out[case])
        assert out["skip=True"]["nbytes"] < out["skip=False"]["nbytes"]
        assert out["snapshot"]["source"] == "snapshot"
        assert out["snapshot"]["step"] == FAULT_STEP
        assert out["snapshot"]["extra_equal"]
    assert [o["snapshot"]["role"] for o in outs] == ["source", "receiver"]


def test_infeasible_cases_call_the_fallback_with_a_reason() -> None:
    outs = run_workers(infeasible, 3)
    for rank, out in enumerate(outs):
        for case in ("step", "nobody", "digest"):
            assert out[case]["source"] == "fallback", case
            assert out[case]["calls"] == 1, case
            assert out[case]["step"] == 1, case  # the fallback checkpoint's step
            assert out[case]["guard_step"] == 1, case
            assert out[case]["restored"], case
        assert "healthy replicas disagree on the global step" in out["step"]["reason"]
        assert "rank 0: 3" in out["step"]["reason"] and "rank 1: 2" in out["step"]["reason"]
        assert "no healthy replica" in out["nobody"]["reason"]
        assert "state digests differ among healthy replicas" in out["digest"]["reason"]
        if rank != 2:
            assert "model structure differs" in out["structure"]["reason"]
        assert "no healthy replica" in out["no_fallback"]
        # All ranks reach the same decision.
        assert out["step"]["reason"] == outs[0]["step"]["reason"]
    assert all(o["feasible"] == (True, 2, 0, (2,)) for o in outs)


def test_one_shard_infeasible_makes_every_shard_fall_back() -> None:
    outs = run_workers(two_shards, 4)
    for rank, out in enumerate(outs):
        bad = out["one_shard_bad"]
        assert bad["source"] == "fallback"
        if rank < 2:
            assert bad["reason"].startswith("another replica group cannot recover")
        assert "disagree on the global step" in bad["reason"]
        fine = out["both_fine"]
        assert fine["source"] == ("peer" if rank < 2 else "none")
        assert fine["step"] == 2


def test_bit_flipped_in_a_bucket_makes_every_rank_fall_back() -> None:
    # Digests are computed while the buckets move: a flipped bit in a bucket received straight
    # into a parameter, one unpacked from scratch, and one received into new optimizer state
    # must each be caught, and every rank must then load the fallback checkpoint.
    outs = run_workers(corrupt_in_flight, 2)
    kinds = outs[0]["kinds"]
    assert len(set(kinds.values())) == 3
    for rank, out in enumerate(outs):
        for case in kinds:
            got = out[case]
            assert got["source"] == "fallback", (rank, case)
            assert got["reason"].startswith(
                "rank 1 received state whose digest does not match the source's"
            ), (case, got["reason"])
            assert got["calls"] == 1 and got["restored"], (rank, case)
        assert out["clean"]["source"] == "peer"
        assert out["clean"]["calls"] == 0 and out["clean"]["peer_state"]
    assert outs[0]["direct"]["reason"] == outs[1]["direct"]["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_restarted_rank_recovers_from_peer() -> None:
    nccl = torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available()
    outs = run_workers(gpu_recover, 2, backend="nccl" if nccl else "gloo")
    for out in outs:
        assert out["source"] == "peer"
        assert out["step"] == FAULT_STEP
        _assert_matches_reference(out)


def test_module_extra_state_and_optimizer_dtypes_arrive_as_the_peer_holds_them() -> None:
    source, receiver = run_workers(extra_state_and_dtypes, 2)
    assert source["source"] == receiver["source"] == "peer", receiver["reason"]
    assert receiver["calls"] == 42 and torch.equal(receiver["amax"], source["amax"])
    for theirs, mine in zip(source["moments"], receiver["moments"], strict=True):
        assert mine.dtype == theirs.dtype == torch.float32  # not cast to the bf16 parameter
        assert torch.equal(mine, theirs)


def test_a_rebuilt_rank_gets_its_frozen_weights_again() -> None:
    source, receiver = run_workers(frozen_twice, 2)
    for (src_kind, theirs), (rcv_kind, mine) in zip(source["frozen"], receiver["frozen"],
                                                    strict=True):  # fmt: skip
        assert src_kind == rcv_kind == "peer"
        assert torch.equal(mine, theirs)


def test_ranks_with_different_settings_refuse_together() -> None:
    outs = run_workers(mismatched_settings, 2)
    for out in outs:
        assert out["source"] == "fallback"
        assert "different PeerRecovery settings" in out["reason"]


def test_a_receiver_that_cannot_apply_takes_every_rank_to_the_fallback() -> None:
    outs = run_workers(apply_fails_on_receiver, 2)
    for out in outs:
        assert out["source"] == "fallback"
        assert "cannot apply the state it received" in out["reason"]
        assert "scheduler state refused" in out["reason"]


def test_a_rank_failing_mid_transfer_takes_every_rank_to_the_fallback_at_once() -> None:
    # Before, the failing rank left the broadcasts and the others waited for the process
    # group's timeout (30 minutes by default).
    outs = run_workers(fails_mid_transfer, 2, timeout=60)
    for case, failing in (("unpack", 1), ("pack", 0)):
        for digest in ("checksum", None):
            got = [out[f"{case}-{digest}"] for out in outs]
            want = f"rank {failing} failed during the transfer: RuntimeError: {case} refused"
            for rank, g in enumerate(got):
                assert g["source"] == "fallback" and g["reason"].startswith(want), (rank, g)
                assert g["calls"] == 1 and g["restored"], (rank, case, digest)
    for out in outs:  # the group is still in step: a clean recovery goes through
        clean = out["clean-checksum"]
        assert clean["source"] == "peer" and clean["calls"] == 0 and clean["peer_state"]
