"""A generation that leaves the index is gone for good: never persisted, pinned or labelled
afterwards, even though its segment is reused at once.

Each test orders the race it covers with events, on the daemon's real parts (in process).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ckptcache.errors import CheckpointNotFound
from ckptcache.format.layout import HEADER_SIZE, SegmentState
from ckptcache.format.manifest import compute_digests, meta_digests
from ckptcache.server.cluster.replication import Replication
from ckptcache.server.state import Incoming, NewerHeld
from ckptcache.wire import messages as m
from ckptcache.wire import peer
from ckptcache.wire.states import PersistState
from tests.helpers import wait_until
from tests.server.conftest import NS, digested, object_bytes, save_object


def _generation(core, path):
    return core.state.index.newest((NS, path))


def _idle(core) -> bool:
    persister = core.persister
    with core.state.lock.held():
        busy = [g for g in core.state.index if g.persist_state == PersistState.PERSISTING]
        return not persister.queue and not busy


def _hold_persists_of(core, path: str) -> threading.Event:
    """Make the persister wait on ``path`` until the returned event is set."""
    gate = threading.Event()
    persist = core.persister._persist

    def held(gen):
        if gen.path == path:
            gate.wait(30)
        return persist(gen)

    core.persister._persist = held
    return gate


def test_a_deleted_queued_generation_is_never_persisted_from_its_reused_segment(
    make_core, tmp_path
):
    root = str(tmp_path / "store")
    os.makedirs(root)
    core = make_core(persist_roots=(root,), persist_workers=1, pool_bytes=0,
                     memory_limit=16 << 20)  # fmt: skip
    a, b, c = (f"{root}/{name}.pt" for name in "abc")
    gate = _hold_persists_of(core, a)
    session = core.saves.open_session(1, os.getuid())
    save_object(core, session, a, torch.zeros(1000))
    wait_until(lambda: _generation(core, a).persist_state == PersistState.PERSISTING)
    saved_b = save_object(core, session, b, torch.full((1000,), 7.0))  # queued behind a
    gen_b = _generation(core, b)
    assert gen_b.persist_state == PersistState.QUEUED
    digested(gen_b)  # unpinned (queued is not pinned): the delete frees its segment at once

    assert core.retention.delete(session, m.DeleteRequest(NS, b)).dropped == 1
    saved_c = save_object(core, session, c, torch.full((1000,), 42.0))
    assert saved_c.segment == saved_b.segment  # b's segment now holds c
    gate.set()
    wait_until(lambda: _idle(core), what="persister idle")

    assert not os.path.exists(b), "a deleted generation was persisted from a reused segment"
    assert gen_b.persist_state == PersistState.DROPPED
    assert torch.equal(torch.load(c)["w"], torch.full((1000,), 42.0))
    gen_c = _generation(core, c)
    assert gen_c.persist_state == PersistState.PERSISTED and not gen_c.corrupt


def test_a_retired_generation_cannot_be_pinned(make_core):
    core = make_core(pool_bytes=0)
    session = core.saves.open_session(1, os.getuid())
    save_object(core, session, "/mem/x.pt", torch.ones(10))
    gen = _generation(core, "/mem/x.pt")
    digested(gen)  # a digester pin would keep the deleted generation retired, not removed
    core.retention.delete(session, m.DeleteRequest(NS, "/mem/x.pt"))
    assert gen.removed
    assert core.state.pin_if_current(gen) is False
    with pytest.raises(CheckpointNotFound):
        core.state.pin(gen)
    gen.digests = None  # as before the digester's pass: ensure() would pin it to hash it
    with pytest.raises(CheckpointNotFound):
        core.digester.ensure(gen)


def test_a_pinned_deleted_generation_does_not_come_back_after_a_restart(make_core, tmp_path):
    core = make_core(pool_bytes=0)
    session = core.saves.open_session(1, os.getuid())
    save_object(core, session, "/mem/y.pt", torch.ones(10))
    gen = _generation(core, "/mem/y.pt")
    core.state.pin(gen)  # a zero-copy load still maps it
    core.retention.delete(session, m.DeleteRequest(NS, "/mem/y.pt"))
    assert gen.segment.read_header().state == SegmentState.FREE

    # A daemon restarted now (before the last pin goes) rebuilds its index from the headers
    # (build_core recovers what the shm directory holds).
    restarted = make_core(shm_dir=core.config.shm_dir, pool_bytes=0)
    assert restarted.state.index.newest((NS, "/mem/y.pt")) is None


def test_an_ingested_copy_never_labels_or_outranks_a_save_committed_meanwhile(make_core):
    core = make_core(pool_bytes=0)
    session = core.saves.open_session(1, os.getuid())
    path = "/mem/p.pt"
    plan, buf = object_bytes(path, torch.full((100,), 1.0))

    def trainer_saves_meanwhile(view, advance):
        view[:] = buf[HEADER_SIZE : HEADER_SIZE + len(view)]
        advance(len(view))
        save_object(core, session, path, torch.full((100,), 2.0))  # the trainer's newer save

    with pytest.raises(NewerHeld):
        core.ingest.receive(Incoming(NS, path, plan.layout.nbytes, plan.layout.manifest_offset,
                                     len(plan.manifest_bytes), trainer_saves_meanwhile,
                                     "storage", verify=False, persisted=True))  # fmt: skip
    gens = core.state.index.generations((NS, path))
    assert len(gens) == 1
    newest = gens[0]
    assert newest.origin == "" and newest.saver is not None  # still the trainer's save
    assert not newest.persisted
    assert newest.segment.read_header().persisted == 0


def test_an_ingested_storage_copy_is_marked_persisted_in_its_commit(make_core, tmp_path):
    root = str(tmp_path / "store")
    os.makedirs(root)
    core = make_core(pool_bytes=0, persist_roots=(root,))
    path = f"{root}/q.pt"
    plan, buf = object_bytes(path, torch.full((100,), 3.0))

    def fill(view, advance):
        view[:] = buf[HEADER_SIZE : HEADER_SIZE + len(view)]
        advance(len(view))

    gen = core.ingest.receive(Incoming(NS, path, plan.layout.nbytes, plan.layout.manifest_offset,
                                       len(plan.manifest_bytes), fill, "storage", verify=False,
                                       persisted=True))  # fmt: skip
    assert gen is _generation(core, path)
    assert gen.origin == "storage" and gen.persisted
    assert gen.persist_state == PersistState.PERSISTED
    header = gen.segment.read_header()
    assert header.persisted == 1 and header.state == SegmentState.COMMITTED
    wait_until(lambda: _idle(core), what="persister idle")
    assert gen.persist_seconds == 0 and not os.path.exists(path)  # never written back
    assert core.queries.wait(None, m.WaitRequest(NS, path, timeout=1)).state == "persisted"


def _push_of(path: str, value: torch.Tensor) -> tuple[peer.PushRequest, list[int]]:
    """A push of ``{"w": value}`` saved earlier on another node, and its digest table."""
    plan, buf = object_bytes(path, value)
    view = memoryview(buf)
    skeleton, _ = meta_digests(view, plan.manifest, plan.layout.manifest_offset,
                               len(plan.manifest_bytes))  # fmt: skip
    request = peer.PushRequest(
        namespace=NS, path=path, nbytes=plan.layout.nbytes,
        manifest_offset=plan.layout.manifest_offset, manifest_size=len(plan.manifest_bytes),
        origin="other", manifest=plan.manifest_bytes.decode(), skeleton_digest=skeleton,
        committed=1.0,
    )  # fmt: skip
    return request, compute_digests(view, plan.manifest)


def test_an_older_push_is_acknowledged_only_by_a_newer_save_of_the_same_content(make_core):
    core = make_core(pool_bytes=0)
    session = core.saves.open_session(1, os.getuid())
    path = "/mem/replica.pt"
    save_object(core, session, path, torch.full((100,), 5.0))  # this replica's own save
    held = _generation(core, path)
    replication = Replication(core.config, core.state, None,  # type: ignore[arg-type]
                              ensure_digests=core.digester.ensure,
                              receive=core.ingest.receive)  # fmt: skip

    same, table = _push_of(path, torch.full((100,), 5.0))
    assert replication._same_content_held(same, NewerHeld("older", table)) is held

    other, table = _push_of(path, torch.full((100,), 6.0))
    with pytest.raises(NewerHeld):
        replication._same_content_held(other, NewerHeld("older", table))


def test_a_copy_keeps_the_commit_time_of_its_content(make_core):
    """What "newest wins" compares (a persist against storage, a restart's recovery) is when
    the content was saved on its origin, not when the copy arrived here."""
    core = make_core(pool_bytes=0)
    path = "/mem/backup.pt"
    plan, buf = object_bytes(path, torch.full((100,), 4.0))

    def fill(view, advance):
        view[:] = buf[HEADER_SIZE : HEADER_SIZE + len(view)]
        advance(len(view))

    saved_on_origin = 1_700_000_000.25
    gen = core.ingest.receive(Incoming(NS, path, plan.layout.nbytes, plan.layout.manifest_offset,
                                       len(plan.manifest_bytes), fill, "origin-node",
                                       verify=False, saved_at=saved_on_origin))  # fmt: skip
    assert gen.committed_ns == int(saved_on_origin * 1e9)
    assert gen.segment.read_header().committed_ns == gen.committed_ns
    assert gen.committed == pytest.approx(saved_on_origin, abs=1e-6)  # ns, back in seconds
