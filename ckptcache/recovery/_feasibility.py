"""Is peer recovery feasible? One all_gather of a fixed-size announcement per rank, then a
pure decision that every rank computes identically from the same table.

Nothing here talks to the network: :func:`decide` is a function of the gathered announcements,
which keeps every rule unit-testable and guarantees all ranks take the same branch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Literal

import torch

__all__ = ["Announcement", "Feasibility", "TransferCheck", "decide", "transfer_problem"]

#: Bumped whenever the announcement layout or the transfer protocol changes.
#: 2: transfers are verified with per-bucket digests gathered after the transfer.
PROTOCOL_VERSION = 3

_U64 = 1 << 64


def to_i64(u: int) -> int:
    """Store an unsigned 64-bit digest in an int64 tensor slot."""
    return u - _U64 if u >= 1 << 63 else u


def to_u64(i: int) -> int:
    return i % _U64


@dataclass(frozen=True)
class Announcement:
    """What one rank tells its replica group before anything is sent (all ints, fixed size)."""

    version: int
    recovering: int
    #: Committed optimizer steps (index of the next step), or -1 when unknown.
    step: int
    #: The step whose optimizer update was interrupted on this rank, or -1.
    in_flight: int
    #: Digest of the model's keys, shapes, dtypes and trainability.
    fingerprint: int
    #: Bit 0 optimizer given, bit 1 scheduler given (bit 2, extra_state, is never set: a
    #: restarted rank passes none and receives the healthy replicas').
    arguments: int
    #: Digests of this rank's live state (0 when recovering or not computed).
    digest: int
    frozen_digest: int
    #: Step held by this rank's host snapshot, or -1.
    snapshot_step: int
    snapshot_digest: int
    snapshot_frozen_digest: int
    #: 1 when this (recovering) rank already holds the frozen weights.
    has_frozen: int
    #: Digest of the settings that decide which collectives a rank runs (bucket size, digest
    #: mode, a global group): ranks that differ would wait on each other for ever.
    settings: int = 0

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Announcement:
        return cls(*(int(v) for v in t.tolist()))

    @classmethod
    def size(cls) -> int:
        return len(fields(cls))


@dataclass(frozen=True)
class Feasibility:
    """The group's decision: ``ok`` (also the truth value) and, when not ok, the ``reason``.

    Identical on every rank of the replica group.
    """

    ok: bool
    reason: str = ""
    #: Step to resume from (committed optimizer steps), when known.
    step: int | None = None
    #: Global rank that sends the state, and whether it sends live state or a host snapshot.
    source_rank: int | None = None
    source_kind: Literal["live", "snapshot"] | None = None
    #: Global ranks that announced they lost their state (or were mid optimizer step).
    recovering_ranks: tuple[int, ...] = ()
    healthy_ranks: tuple[int, ...] = ()
    #: False when every receiver already holds the frozen weights, so they are not sent.
    send_frozen: bool = True
    #: The source's digests (live, frozen) that receivers must reproduce; None when not checked.
    expected_digests: tuple[int, int] | None = None

    def __bool__(self) -> bool:
        return self.ok

    @property
    def receivers(self) -> tuple[int, ...]:
        """Ranks that receive the state (the source restores itself from its own snapshot)."""
        return tuple(r for r in self.recovering_ranks if r != self.source_rank)


def _listing(values: Mapping[int, object]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in values.items())


def _hex(value: int) -> str:
    return f"{to_u64(value):016x}"


def _structure_problem(anns: Sequence[Announcement], ranks: Sequence[int]) -> str | None:
    if len({a.version for a in anns}) > 1:
        versions = {r: a.version for r, a in zip(ranks, anns, strict=True)}
        return f"ranks run different recovery protocol versions ({_listing(versions)})"
    if len({a.fingerprint for a in anns}) > 1:
        prints = {r: _hex(a.fingerprint) for r, a in zip(ranks, anns, strict=True)}
        return (
            "model structure differs between replicas (state keys, shapes or dtypes; "
            f"fingerprints {_listing(prints)})"
        )
    if len({a.settings for a in anns}) > 1:
        return (
            "ranks use different PeerRecovery settings (bucket_bytes, digest or global_group "
            "differ): give every rank the same"
        )
    if len({a.arguments for a in anns}) > 1:
        names = ("optimizer", "scheduler", "extra_state")
        given = {
            r: "+".join(n for b, n in enumerate(names) if a.arguments >> b & 1) or "model only"
            for r, a in zip(ranks, anns, strict=True)
        }
        return f"ranks passed different state to recover() ({_listing(given)})"
    return None


def decide(
    anns: Sequence[Announcement], ranks: Sequence[int], *, verify_digests: bool
) -> Feasibility:
    """The group's decision from every rank's announcement (``ranks`` are global ranks)."""
    problem = _structure_problem(anns, ranks)
    if problem:
        return Feasibility(False, problem)
    by_rank = dict(zip(ranks, anns, strict=True))
    roles = _Roles(
        recovering=tuple(r for r, a in by_rank.items() if a.recovering),
        healthy=tuple(r for r, a in by_rank.items() if not a.recovering),
    )
    if roles.healthy:
        return _from_live(by_rank, roles, verify_digests)
    if any(a.snapshot_step >= 0 for a in anns):
        return _from_snapshot(by_rank, roles, verify_digests)
    mid_step = {r: a.in_flight for r, a in by_rank.items() if a.in_flight >= 0}
    detail = f"; interrupted mid optimizer step: {_listing(mid_step)}" if mid_step else ""
    return roles.fail(
        f"no healthy replica in the replica group: every rank ({', '.join(map(str, ranks))}) "
        f"is recovering and none holds a host snapshot{detail}"
    )


@dataclass(frozen=True)
class _Roles:
    recovering: tuple[int, ...]
    healthy: tuple[int, ...]

    def fail(self, reason: str) -> Feasibility:
        return Feasibility(
            False, reason, recovering_ranks=self.recovering, healthy_ranks=self.healthy
        )

    def succeed(
        self,
        by_rank: dict[int, Announcement],
        *,
        step: int,
        source: int,
        kind: Literal["live", "snapshot"],
        expected: tuple[int, int] | None,
    ) -> Feasibility:
        receivers = [r for r in self.recovering if r != source]
        return Feasibility(
            True,
            step=step,
            source_rank=source,
            source_kind=kind,
            recovering_ranks=self.recovering,
            healthy_ranks=self.healthy,
            # Frozen weights are skipped only when every receiver says it already has them.
            send_frozen=not receivers or not all(by_rank[r].has_frozen for r in receivers),
            expected_digests=expected,
        )


def _digest_problem(
    by_rank: dict[int, Announcement], ranks: Sequence[int], what: str, *, snapshot: bool
) -> tuple[str | None, tuple[int, int]]:
    digests = {
        r: (
            (by_rank[r].snapshot_digest, by_rank[r].snapshot_frozen_digest)
            if snapshot
            else (by_rank[r].digest, by_rank[r].frozen_digest)
        )
        for r in ranks
    }
    if len(set(digests.values())) > 1:
        shown = {r: _hex(d[0]) + "/" + _hex(d[1]) for r, d in digests.items()}
        return f"{what} ({_listing(shown)})", digests[ranks[0]]
    return None, digests[ranks[0]]


def _from_live(by_rank: dict[int, Announcement], roles: _Roles, verify: bool) -> Feasibility:
    steps = {r: by_rank[r].step for r in roles.healthy}
    unknown = [r for r, s in steps.items() if s < 0]
    if unknown:
        return roles.fail(
            f"healthy rank(s) {', '.join(map(str, unknown))} did not say which step they are at "
            "(pass step= or a StepGuard)"
        )
    if len(set(steps.values())) > 1:
        return roles.fail(f"healthy replicas disagree on the global step ({_listing(steps)})")
    expected = None
    if verify:
        problem, expected = _digest_problem(
            by_rank, roles.healthy, "state digests differ among healthy replicas", snapshot=False
        )
        if problem:
            return roles.fail(problem)
    source = roles.healthy[0]
    return roles.succeed(by_rank, step=steps[source], source=source, kind="live", expected=expected)


def _from_snapshot(by_rank: dict[int, Announcement], roles: _Roles, verify: bool) -> Feasibility:
    # Every rank lost its live state but host memory survived: resume from the newest snapshot.
    step = max(a.snapshot_step for a in by_rank.values())
    newest = [r for r, a in by_rank.items() if a.snapshot_step == step]
    expected = None
    if verify:
        problem, expected = _digest_problem(
            by_rank, newest, f"host snapshot digests differ at step {step}", snapshot=True
        )
        if problem:
            return roles.fail(problem)
    return roles.succeed(by_rank, step=step, source=newest[0], kind="snapshot", expected=expected)


@dataclass(frozen=True)
class TransferCheck:
    """What one rank reports after a transfer (all ints, gathered like an announcement).

    ``role``: 0 took no part, 1 source, 2 receiver, 3 bystander (a healthy replica that hashed
    its own state), 4 bystander lacking some of the source's tensors, 5 a rank that failed
    locally during the transfer (its reason follows separately). ``digest`` covers the
    buckets that moved, ``unsent`` the tensors that did not (frozen weights a receiver kept).
    """

    role: int
    digest: int
    unsent: int

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> TransferCheck:
        return cls(*(int(v) for v in t.tolist()))


SOURCE, RECEIVER, BYSTANDER, BYSTANDER_MISSING, FAILED = 1, 2, 3, 4, 5


def transfer_problem(checks: Sequence[TransferCheck], ranks: Sequence[int]) -> str | None:
    """Why the transfer must not be used (None when every digest matches the source's)."""
    by_rank = dict(zip(ranks, checks, strict=True))
    failed = [r for r, c in by_rank.items() if c.role == FAILED]
    if failed:
        return f"rank {failed[0]} failed during the transfer"
    source = next((r for r, c in by_rank.items() if c.role == SOURCE), None)
    if source is None:
        return "no rank reported sending the state"
    want = by_rank[source]
    healthy = {r: c for r, c in by_rank.items() if c.role in (SOURCE, BYSTANDER, BYSTANDER_MISSING)}
    if any(
        c.role == BYSTANDER_MISSING or (c.digest, c.unsent) != (want.digest, want.unsent)
        for c in healthy.values()
    ):
        shown = {
            r: "missing tensors"
            if c.role == BYSTANDER_MISSING
            else _hex(c.digest) + "/" + _hex(c.unsent)
            for r, c in healthy.items()
        }
        return f"state digests differ among healthy replicas ({_listing(shown)})"
    for r, c in by_rank.items():
        if c.role != RECEIVER:
            continue
        if c.digest != want.digest:
            return (
                f"rank {r} received state whose digest does not match the source's "
                f"({_hex(c.digest)} != {_hex(want.digest)}, rank {source})"
            )
        if c.unsent != want.unsent:
            return (
                f"rank {r} skipped frozen weights (skip_frozen) but its own differ from the "
                "source's; reload the base weights or recover without skip_frozen"
            )
    return None
