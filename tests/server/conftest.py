"""Fixtures of the in-process daemon tests: the daemon's parts built by
:func:`ckptcache.server.daemon.build_core` on a private shm directory, no sockets."""

from __future__ import annotations

import shutil
import uuid
from typing import NamedTuple

import pytest
import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.format.manifest import ObjectPlan
from ckptcache.server.cluster import membership as membership_module
from ckptcache.server.cluster.coord.embedded import EmbeddedCoordinator
from ckptcache.server.config import DaemonConfig
from ckptcache.server.daemon import build_core
from ckptcache.wire import messages as m
from tests.helpers import wait_until

NS = "default"


@pytest.fixture
def make_core(tmp_path):
    """``make(**options)``: a core on its own shm directory (``options`` are
    :class:`DaemonConfig` fields); every core made is shut down and its directory removed."""
    made = []

    def make(**options):
        shm = f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:8]}"
        # Memory only is a choice; these parts are tested on temporary paths.
        config = DaemonConfig(**{"shm_dir": shm, "socket": str(tmp_path / "d.sock"),
                                 "node_id": "unit", "memory_only": "allow", **options})  # fmt: skip
        core = build_core(config)
        made.append((core, config.shm_dir))  # the caller's own directory, where it gave one
        return core

    yield make
    for core, shm in made:
        core.shutdown()
        shutil.rmtree(shm, ignore_errors=True)
    # Under the suite's strict switch an unlisted persist-state change raises where it
    # happens, which a worker thread only logs: the count tells the test.
    unlisted = [core.state.persist_states.unlisted for core, _ in made]
    assert not any(unlisted), f"unlisted persist-state transitions: {unlisted}"


@pytest.fixture
def shared_coordinator(monkeypatch):
    """Cluster cores made after this share one embedded coordinator (they stand in for the
    nodes of one cluster, in this process)."""
    shared: dict = {}
    monkeypatch.setattr(
        membership_module, "make_coordinator",
        lambda url, *, cluster, job, ttl: EmbeddedCoordinator(
            f"/ckptcache/{cluster}/{job}/", ttl, store=shared
        ),
    )  # fmt: skip


def object_bytes(path: str, value: torch.Tensor) -> tuple[ObjectPlan, bytearray]:
    """The plan and the segment bytes of ``{"w": value}`` saved at ``path``."""
    flat = flatten({"w": value})
    plan = plan_object(flat, path, NS)
    buf = bytearray(plan.layout.nbytes)
    write_object(memoryview(buf), plan, flat)
    return plan, buf


class Saved(NamedTuple):
    generation: int
    segment: str


def digested(gen) -> None:
    """Wait until the background digester has recorded ``gen``'s digests and dropped its pin
    (call it while the test holds no pin of its own). The digester pins every new generation
    while hashing it, so pin counts or frees checked before then race it."""
    wait_until(lambda: gen.digests is not None and gen.pins == 0, what="the digest recorded")


def written(core, session, path: str, value: torch.Tensor, durability: str = "local"):
    """Reserve a segment for ``{"w": value}`` and write it as the client does; returns the
    reservation and the commit request that would publish it."""
    plan, buf = object_bytes(path, value)
    request = m.ReserveRequest(NS, path, plan.layout.nbytes, durability)
    reply = core.saves.reserve(session, request)
    view = core.state.arena.segments[reply.segment].view()
    try:
        view[: len(buf)] = buf
    finally:
        del view
    commit = m.CommitRequest(reply.reservation, plan.layout.manifest_offset,
                             len(plan.manifest_bytes))  # fmt: skip
    return reply, commit


def save_object(core, session, path: str, value: torch.Tensor) -> Saved:
    """Reserve, write and commit ``{"w": value}`` as the client does."""
    reply, commit = written(core, session, path, value)
    return Saved(core.saves.commit(session, commit).generation, reply.segment)
