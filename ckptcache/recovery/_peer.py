"""Checkpointless recovery: replicas that still hold the state send it to the ranks that lost it.

Protocol, one call of :meth:`PeerRecovery.recover` on every rank of the replica group:

1. announce   all_gather of one fixed-size int64 row per rank (recovering?, step, structure,
              ...); every rank runs the same :func:`decide` on the same table (and, with a
              ``global_group``, agrees with the other replica groups in one all_reduce);
2. plan       the source broadcasts the state's skeleton and tensor specs (a few KiB, pickled),
              or the reason it cannot;
3. prepare    receivers match the specs to their own tensors, allocating what they lack as
              views of flat bucket buffers; one all_reduce says whether all can;
4. transfer   bucketed broadcasts from the source straight into the receivers' tensors; with a
              digest, every rank hashes bucket k while bucket k+1 is on the wire (the source
              what it sends, receivers what they got, other healthy replicas their own state);
5. verify     one all_gather of every rank's digests; every rank runs the same
              :func:`transfer_problem` (then one all_reduce over the global group when given)
              and so decides success or fallback for everyone;
6. apply      receivers load optimizer/scheduler/extra state and RNG; everyone zeroes gradients.

That is six collective round trips besides the buckets, whatever the size of the state (plus
one all_reduce when there is a global group, and a gather of reasons when something failed).

Any "no" along the way makes *every* rank call the fallback, so replicas never end up at
different steps.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ckptcache.format.digest import digest_bytes
from ckptcache.recovery._buckets import (
    DEFAULT_BUCKET_BYTES,
    DIRECT_BYTES,
    PACK_BYTES,
    Bucket,
    BufferPool,
    allocate_flat,
    plan_buckets,
)
from ckptcache.recovery._digests import DigestMode, combine, state_digests, tensor_words
from ckptcache.recovery._feasibility import (
    BYSTANDER,
    BYSTANDER_MISSING,
    FAILED,
    PROTOCOL_VERSION,
    RECEIVER,
    SOURCE,
    Announcement,
    Feasibility,
    TransferCheck,
    decide,
    to_i64,
    transfer_problem,
)
from ckptcache.recovery._guard import StepGuard
from ckptcache.recovery._rng import RngState, capture_rng, restore_rng
from ckptcache.recovery._snapshot import HostSnapshot
from ckptcache.recovery._state import (
    FlatState,
    TensorSpec,
    apply_training_state,
    flat_training_state,
    rebuild,
    unwrap_model,
)
from ckptcache.recovery._transfer import Role, Transfer, broadcast_buckets
from ckptcache.recovery.errors import RecoveryError

__all__ = ["PeerRecovery", "RecoveryResult"]

Fallback = Callable[[], Any]


@dataclass(frozen=True)
class RecoveryResult:
    """Outcome of :meth:`PeerRecovery.recover`; ``source`` and ``step`` agree on every rank.

    ``source`` is where the group's state came from: ``"peer"`` (a healthy replica's live
    state), ``"snapshot"`` (a replica's host snapshot), ``"fallback"`` (the fallback callable,
    see ``reason``), or ``"none"`` (no rank was recovering; nothing was sent).
    """

    source: Literal["peer", "snapshot", "fallback", "none"]
    #: Step to resume from (committed optimizer steps); None if a fallback did not say.
    step: int | None
    #: Why recovery fell back ("" when it did not).
    reason: str = ""
    #: This rank's part: "source", "receiver" or "bystander" (None after a fallback).
    role: Role | None = None
    #: Global rank that sent the state, and the ranks that received it.
    source_rank: int | None = None
    recovered_ranks: tuple[int, ...] = ()
    #: Bytes broadcast in the transfer.
    nbytes: int = 0
    #: The extra_state to continue with (received on receivers, the caller's own elsewhere).
    extra_state: Any = None
    #: Whatever the fallback returned, when it was called.
    fallback_value: Any = None
    #: Wall time of the call on this rank.
    seconds: float = 0.0

    @property
    def recovered(self) -> bool:
        """True when the group resumed without the fallback."""
        return self.source != "fallback"


@dataclass(frozen=True)
class TransferPlan:
    """What the source broadcasts before the tensors: their specs and everything else."""

    step: int
    specs: tuple[TensorSpec, ...]
    #: Indices into ``specs`` that are sent (frozen weights may be left out).
    send: tuple[int, ...]
    skeleton: Any
    rng: RngState | None


@dataclass
class _Local:
    """This rank's view before the exchange (internal)."""

    recovering: bool
    step: int
    in_flight: int
    flat: FlatState
    has_frozen: bool
    arguments: int


class _GroupAbort(Exception):
    """Every rank agreed to fall back, for ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PeerRecovery:
    """Restores ranks that lost their state from data-parallel replicas that still hold it.

    Call order. Every rank of ``replica_group`` (the ranks holding the same model shard) calls
    :meth:`recover` collectively, with the same configuration, at the same point of the loop:

    * healthy ranks pass their live model, optimizer (and scheduler / extra_state) and the step
      they are at (``step=`` or the :class:`StepGuard` given here; it is the number of committed
      optimizer steps, i.e. the step to run next);
    * recovering ranks (restarted process, reset device memory) pass freshly constructed
      objects and ``recovering=True``; a rank whose guard shows an interrupted optimizer step
      counts as recovering automatically;
    * all ranks get the same :class:`RecoveryResult` and continue the loop at ``result.step``.

    With several shards, pass ``global_group`` (e.g. the world group) so that the go/no-go is
    agreed by every replica group: if one shard cannot recover from peers, all fall back.
    :meth:`is_feasible` runs only the agreement (also collectively). Collectives never run in a
    background thread; call from the training thread.

    If the decision is "not feasible" or the transfer fails, every rank calls ``fallback()``
    (e.g. ``lambda: ckptcache.load(path)``); a returned mapping shaped like
    :func:`training_state_dict` is loaded into the objects for you. Without a fallback,
    :class:`RecoveryError` is raised on every rank.

    Wrap the model in ``DistributedDataParallel`` after ``recover`` (or with
    ``init_sync=False``): DDP's constructor broadcasts rank 0's weights, which would overwrite
    healthy replicas if rank 0 is the one recovering.
    """

    def __init__(
        self,
        replica_group: dist.ProcessGroup | None = None,
        *,
        global_group: dist.ProcessGroup | None = None,
        guard: StepGuard | None = None,
        snapshot: HostSnapshot | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        digest: DigestMode | None = "checksum",
        restore_rng_state: bool = True,
        skip_frozen: bool = False,
        device: torch.device | str | None = None,
        pipeline_depth: int = 2,
    ) -> None:
        """Configure recovery for one replica group (default: the whole default group).

        ``digest`` picks the state digest replicas compare and receivers check (None: off).
        ``skip_frozen=True`` on a rank says it already holds the frozen (requires_grad=False)
        weights, e.g. reloaded from the base model, so they are not sent to it. ``device`` is
        where buckets are staged (default: the current CUDA device for NCCL, else the CPU).
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.replica_group = replica_group
        self.global_group = global_group
        self.guard = guard
        self.snapshot = snapshot
        self.bucket_bytes = bucket_bytes
        self.digest: DigestMode | None = digest
        self.restore_rng_state = restore_rng_state
        self.skip_frozen = skip_frozen
        self.pipeline_depth = pipeline_depth
        self._device = torch.device(device) if device is not None else None
        # Set once frozen weights were received, so later recoveries of this process skip them.
        self._holds_frozen = False

    # ----------------------------------------------------------------------------- public API

    def is_feasible(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int | None = None,
        recovering: bool | None = None,
        scheduler: Any = None,
        extra_state: Any = None,
        skip_frozen: bool | None = None,
    ) -> Feasibility:
        """Run only the agreement round (collective; same arguments as :meth:`recover`)."""
        if not _distributed_ready():
            return Feasibility(False, "torch.distributed is not initialised")
        local = self._local(model, optimizer, scheduler, extra_state, step, recovering, skip_frozen)
        return self._agree(local, live_digests=True)

    def recover(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int | None = None,
        recovering: bool | None = None,
        scheduler: Any = None,
        extra_state: Any = None,
        fallback: Fallback | None = None,
        skip_frozen: bool | None = None,
    ) -> RecoveryResult:
        """Bring every rank of the replica group to the same state (collective).

        See the class docstring for who passes what. Receivers get their parameters and
        optimizer tensors overwritten in place where shapes match; optimizer state missing on
        a re-initialised optimizer is materialised from the source's structure.
        """
        start = time.perf_counter()
        args = (model, optimizer, scheduler, extra_state)
        if not _distributed_ready():
            return self._fall_back("torch.distributed is not initialised", fallback, args, start)
        if self.guard is not None and not recovering and self.guard.in_flight is None:
            # A healthy replica re-runs the interrupted step: undo its forward's side effects
            # (BatchNorm statistics, generators) before digests are compared and state is sent.
            self.guard.rewind()
        local = self._local(model, optimizer, scheduler, extra_state, step, recovering, skip_frozen)
        try:
            # Live digests are not computed up front: the transfer hashes while it moves.
            feasibility = self._agree(local, live_digests=False)
        except Exception as e:  # a collective failed: the group is unusable, fall back alone
            return self._fall_back(f"feasibility exchange failed: {e!r}", fallback, args, start)
        if not feasibility.ok:
            return self._fall_back(feasibility.reason, fallback, args, start)
        try:
            return self._transfer_and_apply(local, feasibility, args, start)
        except _GroupAbort as e:
            return self._fall_back(e.reason, fallback, args, start)
        except Exception as e:
            me = dist.get_rank()
            return self._fall_back(f"transfer failed on rank {me}: {e!r}", fallback, args, start)

    # ------------------------------------------------------------------------- local view

    def _local(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        extra_state: Any,
        step: int | None,
        recovering: bool | None,
        skip_frozen: bool | None,
    ) -> _Local:
        guard = self.guard
        in_flight = guard.in_flight if guard is not None else None
        # A replica interrupted inside optimizer.step() holds a mix of old and new tensors.
        lost = bool(recovering) or in_flight is not None
        if step is None and guard is not None:
            step = guard.committed_step
        flat = flat_training_state(model, optimizer, scheduler=scheduler, extra_state=extra_state)
        skip = self.skip_frozen if skip_frozen is None else skip_frozen
        return _Local(
            recovering=lost,
            step=-1 if lost or step is None else step,
            in_flight=-1 if in_flight is None else in_flight,
            flat=flat,
            # A rank recovering again may have been rebuilt (frozen weights re-initialised):
            # only an explicit skip_frozen vouches for them then.
            has_frozen=skip or (self._holds_frozen and not lost),
            # extra_state is not compared: a restarted rank passes none and receives it.
            arguments=(optimizer is not None) | (scheduler is not None) << 1,
        )

    def _announcement(self, local: _Local, live_digests: bool) -> Announcement:
        digest = frozen = 0
        snap_step, snap_digest, snap_frozen = -1, 0, 0
        if self.digest is not None and live_digests and not local.recovering:
            digest, frozen = state_digests(local.flat.specs, local.flat.tensors, self.digest)
        if self.snapshot is not None and self.snapshot.step is not None:
            snap_step = self.snapshot.step
            if self.digest is not None:
                snap_digest, snap_frozen = self.snapshot.digests(self.digest)
        fingerprint = digest_bytes(b"".join(_fingerprint_parts(local.flat)))
        return Announcement(
            version=PROTOCOL_VERSION,
            recovering=int(local.recovering),
            step=local.step,
            in_flight=local.in_flight,
            fingerprint=to_i64(fingerprint),
            arguments=local.arguments,
            digest=to_i64(digest),
            frozen_digest=to_i64(frozen),
            snapshot_step=snap_step,
            snapshot_digest=to_i64(snap_digest),
            snapshot_frozen_digest=to_i64(snap_frozen),
            has_frozen=int(local.has_frozen),
            settings=to_i64(digest_bytes(
                f"{self.bucket_bytes}|{self.digest}|{self.global_group is not None}".encode()
            )),
        )  # fmt: skip

    # ------------------------------------------------------------------------- agreement

    def _agree(self, local: _Local, *, live_digests: bool) -> Feasibility:
        group = self.replica_group
        device = self._control_device(group)
        mine = self._announcement(local, live_digests).to_tensor(device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        ranks = _global_ranks(group)
        feasibility = decide(
            [Announcement.from_tensor(r) for r in rows],
            ranks,
            verify_digests=self.digest is not None,
        )
        if self.global_group is None:
            return feasibility
        return self._agree_globally(feasibility)

    def _agree_globally(self, feasibility: Feasibility) -> Feasibility:
        # One all_reduce over all shards: [any failed, max step, -min step].
        group = self.global_group
        step = feasibility.step if feasibility.step is not None else 0
        flags = torch.tensor(
            [0 if feasibility.ok else 1, step, -step],
            dtype=torch.int64,
            device=self._control_device(group),
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        failed, high, low = (int(v) for v in flags.tolist())
        if failed:
            reasons = _gather_reasons(feasibility.reason if not feasibility.ok else None, group)
            if feasibility.ok:
                return _refuse(feasibility, f"another replica group cannot recover: {reasons}")
            return feasibility
        if high != -low:
            return _refuse(
                feasibility, f"replica groups disagree on the global step (from {-low} to {high})"
            )
        return feasibility

    def _agree_error(self, error: str | None, group: dist.ProcessGroup | None) -> str | None:
        """All ranks of ``group`` learn whether any had an error, and every error's text."""
        flag = torch.tensor([1 if error else 0], device=self._control_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            return None
        return _gather_reasons(error, group)

    # ------------------------------------------------------------------------- transfer

    def _transfer_and_apply(
        self, local: _Local, feas: Feasibility, args: tuple[Any, ...], start: float
    ) -> RecoveryResult:
        model, optimizer, scheduler, extra_state = args
        me = dist.get_rank()
        role: Role = (
            "source"
            if me == feas.source_rank
            else "receiver"
            if me in feas.receivers
            else "bystander"
        )
        assert feas.source_rank is not None and feas.step is not None
        plan: TransferPlan | None = None
        nbytes = 0
        error: str | None = None
        if role == "source" and feas.source_kind == "snapshot":
            assert self.snapshot is not None
            try:
                extra_state = self.snapshot.restore(model, optimizer, scheduler=scheduler)
                local.flat = flat_training_state(
                    model, optimizer, scheduler=scheduler, extra_state=extra_state
                )
            except Exception as e:
                error = f"rank {me} cannot restore its host snapshot: {e!r}"
        if feas.receivers:
            plan, error = self._exchange_plan(local, feas, role, error)
        elif self.digest is not None and len(feas.healthy_ranks) > 1:
            # Nothing moves, so nothing is hashed in flight: compare the healthy replicas here.
            error = self._compare_healthy(local, feas)
        dests: list[torch.Tensor] | None = None
        if plan is not None:
            dests, nbytes, error = self._move(plan, role, local.flat, feas.source_rank, optimizer)
        if role == "receiver" and error is None:
            # Applied before the group's last vote: a rank that cannot load what it received
            # (optimizer or scheduler state, RNG) must take every rank to the fallback with it,
            # or the replicas would leave recovery at different steps.
            assert plan is not None and dests is not None
            try:
                state = rebuild(plan.skeleton, dests)
                extra_state = apply_training_state(
                    model, optimizer, state, scheduler=scheduler, model_in_place=True
                )
                self._restore_rng(plan.rng)
            except Exception as e:
                error = f"rank {me} cannot apply the state it received: {e!r}"
        final_group = self.global_group if self.global_group is not None else self.replica_group
        error = self._agree_error(error, final_group)
        if error is not None:
            raise _GroupAbort(error)
        if role == "receiver":
            self._holds_frozen = True
        elif role == "source" and feas.source_kind == "snapshot":
            assert self.snapshot is not None
            self._restore_rng(self.snapshot.rng_state)
        # Gradients of an aborted forward/backward must not leak into the re-run step.
        unwrap_model(model).zero_grad(set_to_none=True)
        if self.guard is not None:
            self.guard.reset(feas.step)
        source: Literal["peer", "snapshot", "none"] = (
            "none"
            if not feas.recovering_ranks
            else "snapshot"
            if feas.source_kind == "snapshot"
            else "peer"
        )
        return RecoveryResult(
            source=source,
            step=feas.step,
            role=role,
            source_rank=feas.source_rank,
            recovered_ranks=feas.recovering_ranks,
            nbytes=nbytes,
            extra_state=extra_state,
            seconds=time.perf_counter() - start,
        )

    def _move(
        self,
        plan: TransferPlan,
        role: Role,
        flat: FlatState,
        src: int,
        optimizer: torch.optim.Optimizer | None,
    ) -> tuple[list[torch.Tensor] | None, int, str | None]:
        """Prepare, transfer and verify: (receiver's tensors, bytes moved, group's error).

        The error is the same on every rank of the replica group.
        """
        me = dist.get_rank()
        device = self._transfer_device()
        buckets = plan_buckets(
            plan.specs,
            self.bucket_bytes,
            include=plan.send,
            direct_bytes=DIRECT_BYTES,
            pack_bytes=PACK_BYTES,
        )
        dests: list[torch.Tensor] | None = None
        error: str | None = None
        if role == "receiver":
            try:
                _check_optimizer(plan.skeleton.get("optimizer"), optimizer)
                dests = _destinations(plan, flat, device, buckets)
            except Exception as e:
                error = f"rank {me} cannot take the source's state: {e}"
        error = self._agree_error(error, self.replica_group)
        if error is not None:
            return None, 0, error
        own = _own_tensors(plan, flat) if role == "bystander" else None
        tensors = flat.tensors if role == "source" else dests
        with torch.no_grad():
            moved = broadcast_buckets(
                buckets,
                tensors,
                role=role,
                src=src,
                group=self.replica_group,
                device=device,
                pool=BufferPool(device),
                depth=self.pipeline_depth,
                digest=self.digest,
                own=own,
            )
        failure = None
        if moved.error is not None:
            failure = f"rank {me} failed during the transfer: {moved.error}"
        if self.digest is None:
            return dests, moved.nbytes, failure  # shared by the group's last vote
        check = (
            TransferCheck(FAILED, 0, 0)
            if failure is not None
            else self._transfer_check(plan, role, flat, dests, own, moved)
        )
        return dests, moved.nbytes, self._check_transfer(check, failure)

    def _transfer_check(
        self,
        plan: TransferPlan,
        role: Role,
        flat: FlatState,
        dests: list[torch.Tensor] | None,
        own: list[torch.Tensor] | None,
        moved: Transfer,
    ) -> TransferCheck:
        """This rank's digests of what moved (hashed in flight) and of what did not."""
        assert self.digest is not None and moved.digest is not None
        mine: list[torch.Tensor] | tuple[torch.Tensor, ...] | None = (
            flat.tensors if role == "source" else dests if role == "receiver" else own
        )
        if mine is None:
            return TransferCheck(BYSTANDER_MISSING, 0, 0)
        sent = set(plan.send)
        unsent = [i for i in range(len(plan.specs)) if i not in sent]
        unsent_digest = 0
        if unsent:
            # Frozen weights a receiver kept: they do not move, so they are hashed here.
            words = tensor_words([mine[i] for i in unsent], self.digest)
            unsent_digest = combine([plan.specs[i] for i in unsent], words)
        code = {"source": SOURCE, "receiver": RECEIVER, "bystander": BYSTANDER}[role]
        return TransferCheck(code, to_i64(moved.digest), to_i64(unsent_digest))

    def _check_transfer(self, check: TransferCheck, failure: str | None = None) -> str | None:
        """One all_gather of every rank's digests; the same verdict on every rank. A rank that
        failed during the transfer says so in its row, and then every rank (all see the same
        rows) gathers the failures' reasons."""
        group = self.replica_group
        mine = check.to_tensor(self._control_device(group))
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        checks = [TransferCheck.from_tensor(r) for r in rows]
        if any(c.role == FAILED for c in checks):
            return _gather_reasons(failure, group)
        return transfer_problem(checks, _global_ranks(group))

    def _compare_healthy(self, local: _Local, feas: Feasibility) -> str | None:
        """With nobody to receive, check the healthy replicas agree (one all_gather)."""
        assert self.digest is not None
        digest = unsent = 0
        if not local.recovering:
            digest, unsent = state_digests(local.flat.specs, local.flat.tensors, self.digest)
        code = BYSTANDER if not local.recovering else 0
        if dist.get_rank() == feas.source_rank:
            code = SOURCE
        return self._check_transfer(TransferCheck(code, to_i64(digest), to_i64(unsent)))

    def _exchange_plan(
        self, local: _Local, feas: Feasibility, role: Role, error: str | None
    ) -> tuple[TransferPlan | None, str | None]:
        """Broadcast the source's plan, or the reason it has none (then everyone has it)."""
        box: list[Any] = [None]
        if role == "source":
            assert feas.step is not None
            if error is None:
                try:
                    box[0] = self._plan(local, feas)
                    pickle.dumps(box[0])
                except Exception as e:
                    error = f"the source (rank {dist.get_rank()}) cannot serialise its state: {e!r}"
            if error is not None:
                box[0] = error
        # Pickled: only ranks of one training job exchange plans (same trust as the job's PG).
        dist.broadcast_object_list(
            box,
            src=feas.source_rank,
            group=self.replica_group,
            device=self._control_device(self.replica_group),
        )
        plan = box[0]
        if isinstance(plan, str):
            return None, plan
        if not isinstance(plan, TransferPlan):
            raise RecoveryError(f"the source sent {type(plan).__name__}, not a transfer plan")
        return plan, None

    def _plan(self, local: _Local, feas: Feasibility) -> TransferPlan:
        assert feas.step is not None
        specs = local.flat.specs
        rng = None
        if self.restore_rng_state:
            if feas.source_kind == "snapshot" and self.snapshot is not None:
                rng = self.snapshot.rng_state
            elif self.guard is not None and self.guard.rng_state is not None:
                rng = self.guard.rng_state
            else:
                rng = capture_rng()
        return TransferPlan(
            step=feas.step,
            specs=specs,
            send=tuple(i for i, s in enumerate(specs) if feas.send_frozen or not s.frozen),
            skeleton=local.flat.skeleton,
            rng=rng,
        )

    # ------------------------------------------------------------------------- helpers

    def _restore_rng(self, state: RngState | None) -> None:
        if self.restore_rng_state and state is not None:
            restore_rng(state)

    def _fall_back(
        self, reason: str, fallback: Fallback | None, args: tuple[Any, ...], start: float
    ) -> RecoveryResult:
        if fallback is None:
            raise RecoveryError(reason)
        model, optimizer, scheduler, extra_state = args
        value = fallback()
        step = None
        if isinstance(value, Mapping) and "model" in value:
            extra_state = apply_training_state(model, optimizer, value, scheduler=scheduler)
            raw_step = value.get("step")
            step = int(raw_step) if raw_step is not None else None
            rng = value.get("rng")
            if isinstance(rng, RngState):
                self._restore_rng(rng)
        unwrap_model(model).zero_grad(set_to_none=True)
        if self.guard is not None and step is not None:
            self.guard.reset(step)
        return RecoveryResult(
            source="fallback",
            step=step,
            reason=reason,
            extra_state=extra_state,
            fallback_value=value,
            seconds=time.perf_counter() - start,
        )

    def _transfer_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        return self._control_device(self.replica_group)

    def _control_device(self, group: dist.ProcessGroup | None) -> torch.device:
        # NCCL only moves CUDA tensors; gloo moves CPU (and CUDA) tensors.
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def _gather_reasons(reason: str | None, group: dist.ProcessGroup | None) -> str:
    reasons: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    unique = list(dict.fromkeys(r for r in reasons if r))
    return "; ".join(unique) or "a rank reported an error without a reason"


def _refuse(feasibility: Feasibility, reason: str) -> Feasibility:
    return Feasibility(
        False,
        reason,
        recovering_ranks=feasibility.recovering_ranks,
        healthy_ranks=feasibility.healthy_ranks,
    )


def _fingerprint_parts(flat: FlatState) -> list[bytes]:
    # Model structure only: optimizer state legitimately differs on a re-initialised rank.
    return [
        f"{s.path[1]}|{s.shape}|{s.dtype}|{s.frozen}\n".encode()
        for s in flat.specs
        if s.path[0] == "model"
    ]


def _destinations(
    plan: TransferPlan, flat: FlatState, device: torch.device, buckets: Sequence[Bucket]
) -> list[torch.Tensor]:
    """The tensor each spec is received into: the receiver's own when it matches, else new.

    New tensors that fill a packed bucket on their own are views of one flat buffer, so that
    bucket is received in place; the others are allocated one by one.
    """
    local = flat.by_path()
    sent = set(plan.send)
    out: list[torch.Tensor | None] = []
    for i, spec in enumerate(plan.specs):
        mine = local.get(spec.path)
        if mine is not None and mine.dtype == spec.dtype and tuple(mine.shape) == spec.shape:
            out.append(mine)
        elif i not in sent:
            raise RecoveryError(f"{_dotted(spec.path)} is not sent (frozen) and missing here")
        elif spec.path[0] == "model":
            raise RecoveryError(f"model tensor {_dotted(spec.path)} has no matching tensor here")
        else:
            out.append(None)
    for bucket in buckets:
        members = [seg.tensor for seg in bucket.segments]
        if len(members) > 1 and all(
            out[i] is None and _new_device(plan.specs[i], device) == device for i in members
        ):
            for i, t in (allocate_flat(bucket, plan.specs, device) or {}).items():
                out[i] = t
    return [
        t if t is not None else torch.empty(s.shape, dtype=s.dtype, device=_new_device(s, device))
        for s, t in zip(plan.specs, out, strict=True)
    ]


def _new_device(spec: TensorSpec, device: torch.device) -> torch.device:
    # Adam keeps its step counters on the CPU even when the parameters are on a GPU.
    return torch.device("cpu") if spec.device_type == "cpu" else device


def _own_tensors(plan: TransferPlan, flat: FlatState) -> list[torch.Tensor] | None:
    """A healthy bystander's own tensors in the source's order, or None if any is missing."""
    local = flat.by_path()
    out: list[torch.Tensor] = []
    for spec in plan.specs:
        mine = local.get(spec.path)
        if mine is None or mine.dtype != spec.dtype or tuple(mine.shape) != spec.shape:
            return None
        out.append(mine)
    return out


def _check_optimizer(sent: Any, optimizer: torch.optim.Optimizer | None) -> None:
    """Fail before the transfer what optimizer.load_state_dict would fail after it."""
    if sent is None or optimizer is None:
        return
    theirs = [len(g["params"]) for g in sent["param_groups"]]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if theirs != mine:
        raise RecoveryError(
            f"optimizer parameter groups differ (source sizes {theirs}, here {mine})"
        )


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)
