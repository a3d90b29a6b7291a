"""Per-rank bodies of the multi-process recovery tests (imported by the spawned ranks).

Every scenario trains a small model twice in the same process: once without interruption (the
reference) and once with a fault and a recovery. Replicas stay in sync the data-parallel way
(gradients are all-reduced), so the recovered run must match the reference bit for bit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ckptcache.recovery import (
    HostSnapshot,
    PeerRecovery,
    RecoveryError,
    StepGuard,
    training_state_dict,
)
from ckptcache.recovery._buckets import plan_buckets
from ckptcache.recovery._state import flatten

STEPS = 6
FAULT_STEP = 3


class Fault(RuntimeError):
    """The injected failure."""


class Net(nn.Module):
    def __init__(self, batchnorm: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)  # frozen in the PEFT scenario
        self.bn: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.bn(self.embed(x)))))


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    # Its own generator: data must not depend on (or disturb) the global RNG being recovered.
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


@dataclass
class Replica:
    """One rank's training objects."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    guard: StepGuard
    extra: Any = None
    losses: dict[int, torch.Tensor] = field(default_factory=dict)


def make_replica(
    seed: int = 0, *, frozen: bool = False, batchnorm: bool = True, momentum_sgd: bool = False
) -> Replica:
    seed_all(seed)
    model = Net(batchnorm)
    if frozen:
        model.embed.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer: torch.optim.Optimizer
    if momentum_sgd:
        optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(params, lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return Replica(model, optimizer, scheduler, StepGuard(model))


def extra_for(step: int) -> dict[str, Any]:
    return {
        "samples_seen": 8 * step,
        "nested": {"ema": torch.full((3,), float(step)), "tags": ["a", step]},
        "history": [torch.arange(step + 1), ("marker", torch.ones(2, dtype=torch.float64))],
    }


def train_step(
    r: Replica,
    step: int,
    *,
    group: dist.ProcessGroup | None = None,
    ddp: nn.Module | None = None,
    rank_data: int = 0,
    fail: str | None = None,
    sync: bool = True,
) -> None:
    """One data-parallel step; ``fail`` injects a fault: "forward" (this rank dies in forward),
    "notified" (a peer died: abort after backward, before the gradient all-reduce would hang),
    "optimizer" (this rank dies halfway through the optimizer step)."""
    net = ddp if ddp is not None else r.model
    net.train()
    x, y = batch(step, rank_data)
    r.optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(net(x), y)
    r.losses[step] = loss.detach().clone()
    if fail == "forward":
        raise Fault("fault during forward")
    loss.backward()
    if fail == "notified":
        raise Fault("a peer failed; aborting before the gradient all-reduce")
    if ddp is None and sync:
        world = dist.get_world_size(group)
        for p in r.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad /= world
    with r.guard.optimizer_step(step):
        if fail == "optimizer":
            with torch.no_grad():
                r.model.head.weight.add_(1.0)  # half-applied update, then the crash
            raise Fault("fault during optimizer step")
        r.optimizer.step()
        r.scheduler.step()
    r.extra = extra_for(step + 1)


def state_of(r: Replica) -> dict[str, Any]:
    return training_state_dict(
        r.model,
        r.optimizer,
        step=r.guard.committed_step,
        scheduler=r.scheduler,
        extra_state=r.extra,
    )


def bitwise_equal(a: Any, b: Any) -> bool:
    """Structural equality with torch.equal (and dtype) on tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def snapshot_tensors(state: Any) -> Any:
    """A deep copy (cloned tensors) so later training does not change what was recorded."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot_tensors(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot_tensors(v) for v in state)
    return state


def reference(**replica_kwargs: Any) -> tuple[dict[int, torch.Tensor], Any]:
    r = make_replica(**replica_kwargs)
    r.extra = extra_for(0)
    for s in range(STEPS):
        train_step(r, s)
    return r.losses, snapshot_tensors(state_of(r))


def _outcome(r: Replica, result: Any, ref_losses: Any, ref_state: Any) -> dict[str, Any]:
    return {
        "source": result.source,
        "step": result.step,
        "role": result.role,
        "reason": result.reason,
        "nbytes": result.nbytes,
        "recovered_ranks": result.recovered_ranks,
        "losses_equal": all(
            torch.equal(r.losses[s], ref_losses[s]) for s in range(result.step or 0, STEPS)
        ),
        "state_equal": bitwise_equal(snapshot_tensors(state_of(r)), ref_state),
        "model_equal": bitwise_equal(r.model.state_dict(), ref_state["model"]),
        "optimizer_equal": bitwise_equal(r.optimizer.state_dict(), ref_state["optimizer"]),
    }


# --------------------------------------------------------------------------- scenarios


def wipe_and_recover(
    rank: int, world: int, fault: str, lost: tuple[int, ...], bucket_bytes: int
) -> dict[str, Any]:
    """Train, inject ``fault`` at FAULT_STEP on ranks ``lost``, recover from peers, finish.

    fault: "restart" (between steps, process restarted), "forward" (during forward/backward,
    process restarted), "optimizer" (inside the optimizer step, process survives).
    """
    ref_losses, ref_state = reference()
    r = make_replica()
    r.extra = extra_for(0)
    for s in range(FAULT_STEP):
        train_step(r, s)
    recovering: bool | None = False
    if fault == "restart":
        if rank in lost:
            r, recovering = make_replica(seed=100 + rank), True
            seed_all(999)  # a restarted process has unrelated generator states
    elif fault in ("forward", "optimizer"):
        try:
            healthy_fault = "notified" if fault == "forward" else None
            train_step(r, FAULT_STEP, fail=fault if rank in lost else healthy_fault)
        except Fault:
            pass
        if rank in lost and fault == "forward":
            r, recovering = make_replica(seed=100 + rank), True
            seed_all(999)
        elif rank in lost:
            recovering = None  # the guard knows: its optimizer step is still in flight
    recovery = PeerRecovery(guard=r.guard, bucket_bytes=bucket_bytes)
    result = recovery.recover(
        r.model,
        r.optimizer,
        scheduler=r.scheduler,
        extra_state=None if rank in lost else r.extra,
        recovering=recovering,
    )
    r.extra = result.extra_state
    extra_ok = bitwise_equal(r.extra, extra_for(result.step))
    assert result.step is not None
    for s in range(result.step, STEPS):
        train_step(r, s)
    out = _outcome(r, result, ref_losses, ref_state)
    out["extra_equal"] = extra_ok
    return out


def ddp_recover(rank: int, world: int) -> dict[str, Any]:
    """DDP-wrapped model, recovering rank 0 (whose weights DDP would broadcast at init)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run_ref() -> tuple[dict[int, torch.Tensor], Any]:
        r = make_replica(batchnorm=False, momentum_sgd=True)
        ddp = DDP(r.model)
        for s in range(STEPS):
            train_step(r, s, ddp=ddp, rank_data=rank)
        return r.losses, snapshot_tensors(state_of(r))

    ref_losses, ref_state = run_ref()
    r = make_replica(batchnorm=False, momentum_sgd=True)
    ddp = DDP(r.model)
    for s in range(FAULT_STEP):
        train_step(r, s, ddp=ddp, rank_data=rank)
    lost = rank == 0
    if lost:
        r = make_replica(seed=7, batchnorm=False, momentum_sgd=True)
    # After a fault the job rebuilds its process group and DDP wrappers on every rank; no
    # init sync, or rank 0's fresh weights would be broadcast over the healthy replica's.
    ddp = DDP(r.model, init_sync=False)
    result = PeerRecovery(guard=r.guard, bucket_bytes=1 << 20).recover(
        ddp, r.optimizer, scheduler=r.scheduler, recovering=lost
    )
    assert result.step is not None
    for s in range(result.step, STEPS):
        train_step(r, s, ddp=ddp, rank_data=rank)
    return _outcome(r, result, ref_losses, ref_state)


def frozen_and_snapshot(rank: int, world: int) -> dict[str, Any]:
    """PEFT-style frozen weights skipped on request; then a recovery from host snapshots."""
    out: dict[str, Any] = {}
    ref_losses, ref_state = reference(frozen=True)
    for skip in (False, True):
        r = make_replica(frozen=True)
        r.extra = extra_for(0)
        for s in range(FAULT_STEP):
            train_step(r, s)
        lost = rank == 1
        if lost:
            base = make_replica(frozen=True).model  # "loaded from the base model"
            r = make_replica(seed=5, frozen=True)
            r.model.embed.load_state_dict(base.embed.state_dict())
        result = PeerRecovery(guard=r.guard, skip_frozen=skip).recover(
            r.model, r.optimizer, scheduler=r.scheduler, extra_state=r.extra, recovering=lost
        )
        r.extra = result.extra_state
        assert result.step is not None
        for s in range(result.step, STEPS):
            train_step(r, s)
        out[f"skip={skip}"] = _outcome(r, result, ref_losses, ref_state)

    # Every replica loses its live state (device memory reset), host snapshots survive.
    ref_losses, ref_state = reference()
    r = make_replica()
    snap = HostSnapshot(every=1)
    r.extra = extra_for(0)
    for s in range(FAULT_STEP):
        train_step(r, s)
        snap.maybe_capture(
            r.model,
            r.optimizer,
            step=r.guard.committed_step,
            scheduler=r.scheduler,
            extra_state=r.extra,
        )
    r = make_replica(seed=50 + rank)
    seed_all(77)
    result = PeerRecovery(guard=r.guard, snapshot=snap).recover(
        r.model, r.optimizer, scheduler=r.scheduler, recovering=True
    )
    r.extra = result.extra_state
    extra_ok = bitwise_equal(r.extra, extra_for(FAULT_STEP))
    assert result.step is not None
    for s in range(result.step, STEPS):
        train_step(r, s)
    out["snapshot"] = _outcome(r, result, ref_losses, ref_state)
    out["snapshot"]["extra_equal"] = extra_ok
    return out


def infeasible(rank: int, world: int) -> dict[str, Any]:
    """Each infeasible case must call the fallback on every rank and say why."""
    out: dict[str, Any] = {}
    saved = snapshot_tensors(state_of(_trained(1)))  # the "last checkpoint", at step 1
    calls: list[str] = []

    def fallback() -> Any:
        calls.append("called")
        return saved

    def attempt(name: str, r: Replica, **kwargs: Any) -> None:
        calls.clear()
        result = PeerRecovery(guard=r.guard).recover(
            r.model, r.optimizer, scheduler=r.scheduler, fallback=fallback, **kwargs
        )
        out[name] = {
            "source": result.source,
            "reason": result.reason,
            "step": result.step,
            "calls": len(calls),
            "guard_step": r.guard.committed_step,
            "restored": bitwise_equal(r.model.state_dict(), saved["model"]),
        }

    # Healthy replicas at different steps (rank 2 recovering).
    r = _trained(3 if rank == 0 else 2)
    attempt("step", r, recovering=rank == 2)
    # Nobody healthy.
    attempt("nobody", _trained(2), recovering=True)
    # Same step, but one healthy replica's weights were silently corrupted.
    r = _trained(2)
    if rank == 1:
        with torch.no_grad():
            r.model.head.bias[0] += 1e-3
    attempt("digest", r, recovering=rank == 2)
    # A rank built a different model.
    r = _trained(2)
    if rank == 2:
        r.model.head = nn.Linear(16, 5)
        r.optimizer = torch.optim.Adam(r.model.parameters())
        r.scheduler = torch.optim.lr_scheduler.StepLR(r.optimizer, step_size=2)
    try:
        attempt("structure", r, recovering=rank == 2)
    except RuntimeError as e:  # the fallback's model does not fit rank 2's odd model
        out["structure"] = {"error": str(e)}
    # No fallback: every rank raises RecoveryError with the reason.
    r = _trained(2)
    try:
        PeerRecovery(guard=r.guard).recover(r.model, r.optimizer, recovering=True)
        out["no_fallback"] = "no error"
    except RecoveryError as e:
        out["no_fallback"] = e.reason
    # And a feasible check, for contrast.
    r = _trained(2)
    feas = PeerRecovery(guard=r.guard).is_feasible(
        r.model, r.optimizer, scheduler=r.scheduler, recovering=rank == 2
    )
    out["feasible"] = (feas.ok, feas.step, feas.source_rank, feas.recovering_ranks)
    return out


def _trained(steps: int) -> Replica:
    r = make_replica()
    for s in range(steps):
        # No gradient all-reduce: ranks deliberately train different step counts here, and the
        # data is the same on every rank, so replicas still agree.
        train_step(r, s, sync=False)
    return r


def two_shards(rank: int, world: int) -> dict[str, Any]:
    """Ranks {0,1} and {2,3} each replicate one shard; one shard's problem stops both."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    out: dict[str, Any] = {}
    for case in ("one_shard_bad", "both_fine"):
        r = make_replica()
        for s in range(2):
            train_step(r, s, group=mine)
        step = r.guard.committed_step
        if case == "one_shard_bad" and rank == 3:
            step += 1  # shard {2,3}: its healthy replicas disagree
        lost = rank == 1
        if lost:
            r = make_replica(seed=3)
        result = PeerRecovery(mine, global_group=dist.group.WORLD, guard=r.guard).recover(
            r.model,
            r.optimizer,
            scheduler=r.scheduler,
            step=None if lost else step,
            recovering=lost,
            fallback=lambda: None,
        )
        out[case] = {"source": result.source, "reason": result.reason, "step": result.step}
    return out


def gpu_recover(rank: int, world: int) -> dict[str, Any]:
    """The restart scenario with CUDA tensors (NCCL with 2+ GPUs, else gloo on one GPU)."""
    torch.cuda.manual_seed_all(0)
    device = torch.device("cuda", torch.cuda.current_device())

    def build(seed: int) -> Replica:
        r = make_replica(seed)
        r.model.to(device)
        r.optimizer = torch.optim.Adam(r.model.parameters(), lr=0.01)
        r.scheduler = torch.optim.lr_scheduler.StepLR(r.optimizer, step_size=2, gamma=0.5)
        return r

    def step_on(r: Replica, s: int) -> None:
        x, y = batch(s)
        r.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(r.model(x.to(device)), y.to(device))
        r.losses[s] = loss.detach().cpu()
        loss.backward()
        for p in r.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        with r.guard.optimizer_step(s):
            r.optimizer.step()
            r.scheduler.step()

    torch.cuda.manual_seed(0)
    ref = build(0)
    for s in range(STEPS):
        step_on(ref, s)
    ref_state = snapshot_tensors(state_of(ref))
    torch.cuda.manual_seed(0)
    r = build(0)
    for s in range(FAULT_STEP):
        step_on(r, s)
    lost = rank == 1
    if lost:
        r = build(11)
    result = PeerRecovery(guard=r.guard, bucket_bytes=4096).recover(
        r.model, r.optimizer, scheduler=r.scheduler, recovering=lost
    )
    assert result.step is not None
    for s in range(result.step, STEPS):
        step_on(r, s)
    return _outcome(r, result, ref.losses, ref_state)


def _bucket_kinds(state: Any, bucket_bytes: int) -> dict[str, int]:
    """Index of one bucket of each kind a restarted receiver handles differently."""
    specs = flatten(state).specs
    buckets = plan_buckets(specs, bucket_bytes, direct_bytes=bucket_bytes)

    def first(pred: Any) -> int:
        return next(i for i, b in enumerate(buckets) if pred(b))

    def model(b: Any) -> bool:
        return all(specs[s.tensor].path[0] == "model" for s in b.segments)

    return {
        # straight into a live parameter
        "direct": first(lambda b: len(b.segments) == 1 and model(b)),
        # into a scratch buffer, then copied into the live parameters
        "packed": first(lambda b: len(b.segments) > 1 and model(b)),
        # into the optimizer state the receiver allocates as views of one buffer
        "in_place": first(lambda b: len(b.segments) > 1 and not model(b)),
    }


def corrupt_in_flight(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 restarts; one bucket it receives has a bit flipped after it left the wire."""
    bucket_bytes = 256
    saved = snapshot_tensors(state_of(_trained(1)))  # the "last checkpoint", at step 1
    kinds = _bucket_kinds(state_of(_trained(2)), bucket_bytes)
    out: dict[str, Any] = {"kinds": kinds}
    real_broadcast = dist.broadcast
    for case in (*kinds, "clean"):
        calls: list[int] = []
        r = _trained(2)
        lost = rank == 1
        if lost:
            r = make_replica(seed=7)
            if case != "clean":
                dist.broadcast = _flipping(real_broadcast, kinds[case])  # type: ignore[assignment]
        try:
            result = _recover_at_two(r, lost, saved, calls, bucket_bytes=bucket_bytes)
        finally:
            dist.broadcast = real_broadcast  # type: ignore[assignment]
        out[case] = _fallback_outcome(r, result, calls, saved)
    return out


def _recover_at_two(r: Replica, lost: bool, saved: Any, calls: list[int], **settings: Any) -> Any:
    """Recover replicas trained 2 steps (``lost``: this one was rebuilt) with ``saved`` as the
    fallback checkpoint; each fallback call appends to ``calls``."""
    return PeerRecovery(guard=r.guard, **settings).recover(
        r.model,
        r.optimizer,
        scheduler=r.scheduler,
        step=None if lost else 2,
        recovering=lost,
        fallback=lambda: calls.append(1) or saved,
    )


def _fallback_outcome(r: Replica, result: Any, calls: list[int], saved: Any) -> dict[str, Any]:
    """Where a recovery of :func:`_recover_at_two` left this replica."""
    return {
        "source": result.source,
        "reason": result.reason,
        "calls": len(calls),
        "restored": bitwise_equal(r.model.state_dict(), saved["model"]),
        "peer_state": bitwise_equal(r.model.state_dict(), state_of(_trained(2))["model"]),
    }


def _flipping(broadcast: Any, index: int) -> Any:
    """``dist.broadcast`` whose ``index``-th tensor broadcast gets one bit flipped on arrival."""
    count = [0]

    class Flipped:
        def __init__(self, work: Any, tensor: torch.Tensor) -> None:
            self.work, self.tensor = work, tensor

        def wait(self) -> bool:
            self.work.wait()
            raw = self.tensor.view(-1).view(torch.uint8)
            raw[raw.numel() // 2] ^= 1
            return True

    def wrapper(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        work = broadcast(tensor, src=src, group=group, async_op=async_op)
        count[0] += 1
        if count[0] - 1 != index:
            return work
        assert async_op, "the transfer issues its buckets asynchronously"
        return Flipped(work, tensor)

    return wrapper


# ---------------------------------------------------------------------------- state outside
# the plain tensors, settings and failures that must take every rank the same way


class Scaled(nn.Module):
    """A layer with scaling state kept through get/set_extra_state (as FP8 layers keep their
    amax history): a plain attribute, not a parameter or buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.amax = torch.zeros(4)
        self.calls = 0

    def get_extra_state(self) -> dict[str, Any]:
        return {"amax": self.amax.clone(), "calls": self.calls}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.amax, self.calls = state["amax"].clone(), state["calls"]


def extra_state_and_dtypes(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 recovers a bf16 model whose healthy replica keeps fp32 momentum and module
    extra state."""
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), nn.Linear(4, 4)).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lost = rank == 1
    if not lost:
        model[0].amax.fill_(3.0)
        model[0].calls = 42
        for i, p in enumerate(model.parameters()):
            optimizer.state[p]["momentum_buffer"] = torch.full(p.shape, 1e-3 * (i + 1))
    result = PeerRecovery(digest="checksum").recover(
        model, optimizer, step=5, recovering=lost, fallback=lambda: None
    )
    moments = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return {"source": result.source, "reason": result.reason, "amax": model[0].amax.clone(),
            "calls": model[0].calls, "moments": moments}  # fmt: skip


def frozen_twice(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 recovers twice with one PeerRecovery, its model rebuilt before each recovery
    (frozen weights re-initialised): the second recovery must send them again."""
    r = make_replica(frozen=True)
    for s in range(FAULT_STEP):
        train_step(r, s)
    recovery = PeerRecovery(guard=r.guard, digest=None)
    lost, frozen = rank == 1, []
    for attempt in range(2):
        if lost:
            r = make_replica(seed=100 + attempt, frozen=True)
        result = recovery.recover(r.model, r.optimizer, scheduler=r.scheduler, recovering=lost,
                                  fallback=lambda: None)  # fmt: skip
        frozen.append((result.source, r.model.embed.weight.detach().clone()))
    return {"frozen": frozen}


def mismatched_settings(rank: int, world: int) -> dict[str, Any]:
    """The ranks were given different bucket sizes: refused on both, before any transfer."""
    r = make_replica()
    recovery = PeerRecovery(bucket_bytes=1024 if rank == 0 else 4096)
    result = recovery.recover(r.model, r.optimizer, scheduler=r.scheduler, step=3,
                              recovering=rank == 1, fallback=lambda: None)  # fmt: skip
    return {"source": result.source, "reason": result.reason}


def apply_fails_on_receiver(rank: int, world: int) -> dict[str, Any]:
    """The receiver cannot load the scheduler state it received: every rank falls back."""
    r = make_replica()
    for s in range(FAULT_STEP):
        train_step(r, s)
    lost = rank == 1
    if lost:
        r = make_replica(seed=7)

        def refuse(state: Any) -> None:
            raise RuntimeError("scheduler state refused")

        r.scheduler.load_state_dict = refuse  # type: ignore[method-assign]
    result = PeerRecovery(guard=r.guard).recover(
        r.model, r.optimizer, scheduler=r.scheduler, recovering=lost, fallback=lambda: None
    )
    return {"source": result.source, "reason": result.reason}


def fails_mid_transfer(rank: int, world: int) -> dict[str, Any]:
    """A rank's pack or unpack raises in the middle of the bucketed broadcasts (digests on
    and off): every rank must leave at once with the same reason and load the fallback, and
    the group must stay usable (a clean recovery afterwards goes through)."""
    from ckptcache.recovery import _transfer

    saved = snapshot_tensors(state_of(_trained(1)))
    out: dict[str, Any] = {}
    cases = (("unpack", 1, "checksum"), ("unpack", 1, None), ("pack", 0, "checksum"),
             ("pack", 0, None), ("clean", -1, "checksum"))  # fmt: skip
    for step_name, failing_rank, digest in cases:
        calls: list[int] = []
        r = _trained(2)
        lost = rank == 1
        if lost:
            r = make_replica(seed=7)
        real = getattr(_transfer, step_name, None)
        if rank == failing_rank:

            def refuse(*args: Any, _name: str = step_name) -> None:
                raise RuntimeError(f"{_name} refused on purpose")

            setattr(_transfer, step_name, refuse)
        try:
            result = _recover_at_two(r, lost, saved, calls, bucket_bytes=256, digest=digest)
        finally:
            if rank == failing_rank:
                setattr(_transfer, step_name, real)
        out[f"{step_name}-{digest}"] = _fallback_outcome(r, result, calls, saved)
    return out
