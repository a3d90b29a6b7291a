"""A job's first save takes the plan the daemon keeps for its structure, from the segment of an
earlier save (:mod:`ckptcache.codec.plan.stored`), even where that save is the trainer's
first contact; what it saves is the trainer's state, byte for byte, and a plan that does not
check out against the save's own key is never used."""

from __future__ import annotations

import mmap
import os
import shutil
from collections import OrderedDict

import pytest
import torch

import ckptcache.codec.plan.stored as stored_module
from ckptcache.codec.plan.stored import (
    plan_check,
    plan_from_segment,
    record_columns,
    structure_digest,
)
from ckptcache.server.plans import PlanIndex
from ckptcache.server.state import Session
from ckptcache.wire import messages as m


def model(fill: float, count: int = 40) -> OrderedDict:
    state = OrderedDict(
        (f"layers.{i}.weight", torch.full((64, 16), fill + i)) for i in range(count)
    )
    state["shared"] = state["layers.0.weight"]  # a storage shared by two names
    state["view"] = state["layers.1.weight"][3:9, 2:]  # a view into the middle of one
    state["steps"] = [1.5, "adam", None, (2, 3)]
    return state


def counts(client) -> tuple[int, int, int]:
    plans = client._saves._plans
    return (plans.adopted, plans.hits, plans.misses) if plans is not None else (0, 0, 0)


def equal(a: dict, b: dict) -> bool:
    if list(a) != list(b):
        return False
    for k in a:
        if isinstance(a[k], torch.Tensor):
            if not (torch.equal(a[k], b[k]) and a[k].stride() == b[k].stride()):
                return False
        elif a[k] != b[k]:
            return False
    return True


def test_a_first_contact_save_takes_the_daemons_plan(daemon_factory, tmp_path):
    """The new trainer's save is its first call: its plan comes from step 1's copy, and what
    it saved is its own state, through the tensor table and through the skeleton alone
    (``torch.load`` of the persisted file)."""
    root = tmp_path / "ckpt"
    d = daemon_factory("--persist-root", str(root))
    job = root / "job"
    with d.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="persisted")
    with d.client() as trainer:
        state = model(7.0)
        path = str(job / "step-2" / "model.pt")
        trainer.save(state, path, durability="persisted")
        assert counts(trainer) == (1, 1, 0)  # taken from the daemon: no fresh plan
        loaded = trainer.load(path)
        assert equal(loaded, state)
        assert loaded["shared"].data_ptr() == loaded["layers.0.weight"].data_ptr()
        assert equal(torch.load(path, weights_only=True), state)
        trainer.save(model(9.0), path, durability="memory")  # a repeated save: a hit
        assert counts(trainer) == (1, 2, 0)
        assert equal(trainer.load(path, mmap=False), model(9.0))


def test_another_structure_under_the_same_name_plans_afresh(daemon, tmp_path):
    """Step 1 held another structure (one tensor more): the new trainer's first save plans
    afresh and saves its own state."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0, count=41), str(job / "step-1" / "model.pt"), durability="memory")
    with daemon.client() as trainer:
        state = model(3.0)
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(trainer) == (0, 0, 1)
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)


def test_other_tensor_geometry_plans_afresh(daemon, tmp_path):
    """Same keys, one tensor of another shape and another dtype: not the same structure."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")
    with daemon.client() as trainer:
        state = model(3.0)
        state["layers.5.weight"] = torch.full((16, 64), 2.0)
        state["layers.6.weight"] = state["layers.6.weight"].double()
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(trainer) == (0, 0, 1)
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)


def _doctor(daemon, client, path: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) in the skeleton of ``path``'s cached copy."""
    info = client.status(path)
    with open(os.path.join(daemon.segments_dir, info.segment), "r+b") as f:
        data = mmap.mmap(f.fileno(), 0)
        at = data.find(old)
        assert at > 0
        data[at : at + len(new)] = new
        data.close()


def test_a_doctored_skeleton_is_refused(daemon, tmp_path):
    """Step 1's skeleton was written over in the segment (another key): its plan no longer
    checks out, and the new save plans afresh with its own keys."""
    job = tmp_path / "job"
    earlier_path = str(job / "step-1" / "model.pt")
    with daemon.client() as earlier:
        earlier.save(model(1.0), earlier_path, durability="memory")
        _doctor(daemon, earlier, earlier_path, b"layers.7.weight", b"layers.7.weighu")
    with daemon.client() as trainer:
        state = model(3.0)
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(trainer) == (0, 0, 1)
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)


def test_a_plan_read_from_a_segment_is_checked_against_the_key(daemon, tmp_path):
    """``plan_from_segment``: the plan where its check with the given key and integers is
    the one given; with another key, other integers, another check, bytes written over in
    the segment, no manifest where one is said to be, a segment file cut short or gone:
    nothing. ``find_plan`` says which segment holds the path's newest generation."""
    from ckptcache.codec.plan.walk import walk

    walked = walk(model(5.0), versions=False)
    if walked is None:
        pytest.skip("the compiled walk is not built")
    path = str(tmp_path / "job" / "step-1" / "model.pt")
    with daemon.client() as c:
        c.save(model(1.0), path, durability="memory")
        kept = c._saves._plans.to_keep(path)
        assert kept is None  # told the daemon at the commit
        reply = _find(c, walked.key)
        assert reply.path == path and reply.ints == (2, 3)  # the tuple in ``steps``
        assert reply.segment == c.status(path).segment
        segment = os.path.join(daemon.segments_dir, reply.segment)
        at = (segment, reply.manifest_offset, reply.manifest_size)
        plan = plan_from_segment(*at, walked.key, (2, 3), reply.check)
        assert plan is not None and plan.table and plan.key == walked.key
        assert [i.key for i in plan.flat.infos] == [str(i) for i in range(40)]
        assert plan.flat.infos[0].name == "layers.0.weight"
        records = record_columns(plan.flat.infos)
        assert plan_check(walked.key, (2, 3), plan.flat.skeleton, plan.table, records) == (
            reply.check
        )
        other = walk(model(5.0, count=41), versions=False)
        assert plan_from_segment(*at, other.key, (2, 3), reply.check) is None
        assert plan_from_segment(*at, walked.key, (2, 4), reply.check) is None
        assert plan_from_segment(*at, walked.key, (2, 3), "0" * 64) is None
        assert plan_from_segment(segment, 0, 16, walked.key, (2, 3), reply.check) is None
        cut = tmp_path / "cut"
        shutil.copyfile(segment, cut)
        assert plan_from_segment(str(cut), *at[1:], walked.key, (2, 3), reply.check) is not None
        os.truncate(cut, reply.manifest_offset + reply.manifest_size - 1)
        assert plan_from_segment(str(cut), *at[1:], walked.key, (2, 3), reply.check) is None
        gone = str(tmp_path / "gone")
        assert plan_from_segment(gone, *at[1:], walked.key, (2, 3), reply.check) is None
        _doctor(daemon, c, path, b"adam", b"adan")
        assert plan_from_segment(*at, walked.key, (2, 3), reply.check) is None
        c.delete(path)
        assert _find(c, walked.key) == m.FindPlanReply(path, reply.check, (2, 3))  # no segment


def _find(client, key: bytes) -> m.FindPlanReply:
    request = m.FindPlanRequest("default", structure_digest(key))
    return client._connection.call("find_plan", request, m.FindPlanReply)


def test_a_plan_kept_with_a_false_check_is_refused(daemon, tmp_path):
    """A ``keep_plan`` that names step 1 (another structure) for the new trainer's structure:
    the trainer reads it, finds that it does not check out, plans afresh."""
    from ckptcache.codec.plan.walk import walk

    job = tmp_path / "job"
    state = model(3.0)
    walked = walk(state, versions=False)
    if walked is None:
        pytest.skip("the compiled walk is not built")
    with daemon.client() as earlier:
        earlier.save(model(1.0, count=41), str(job / "step-1" / "model.pt"), durability="memory")
        lie = m.KeepPlanRequest(
            "default", str(job / "step-1" / "model.pt"), structure_digest(walked.key),
            _find(earlier, walk(model(1.0, count=41), versions=False).key).check,
        )  # fmt: skip
        earlier._connection.call("keep_plan", lie)
    with daemon.client() as trainer:
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(trainer) == (0, 0, 1)
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)


def test_the_daemon_answers_a_user_with_its_own_plans_only():
    """Another user's ``keep_plan`` of the same structure is never handed to this one; the
    newest of a user's is; malformed digests are refused."""
    index = PlanIndex(most=2)
    mine, theirs = Session(1, 100, 1000), Session(2, 200, 2000)
    digest = "ab" * 32
    index.keep(theirs, m.KeepPlanRequest("default", "/theirs.pt", digest, "cd" * 32))
    assert index.find(mine, m.FindPlanRequest("default", digest)).path == ""
    index.keep(mine, m.KeepPlanRequest("default", "/mine.pt", digest, "ef" * 32, (3,)))
    assert index.find(mine, m.FindPlanRequest("default", digest)) == m.FindPlanReply(
        "/mine.pt", "ef" * 32, (3,)
    )
    assert index.find(mine, m.FindPlanRequest("other", digest)).path == ""
    assert index.find(theirs, m.FindPlanRequest("default", digest)).path == "/theirs.pt"
    index.keep(mine, m.KeepPlanRequest("default", "/x.pt", "12" * 32, "ef" * 32))
    assert index.find(theirs, m.FindPlanRequest("default", digest)).path == ""  # the oldest
    with pytest.raises(ValueError):
        index.keep(mine, m.KeepPlanRequest("default", "/x.pt", "not hex", "ef" * 32))


def test_the_plan_goes_on_from_job_to_job(daemon, tmp_path):
    """Each job's first save tells the daemon where its plan lies: the third job finds it in
    the second's checkpoint, the first's being deleted."""
    job = tmp_path / "job"
    with daemon.client() as first:
        first.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")
    with daemon.client() as second:
        second.save(model(2.0), str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(second) == (1, 1, 0)
        second.delete(str(job / "step-1" / "model.pt"))
    with daemon.client() as third:
        state = model(3.0)
        third.save(state, str(job / "step-3" / "model.pt"), durability="memory")
        assert counts(third) == (1, 1, 0)
        assert equal(third.load(str(job / "step-3" / "model.pt"), mmap=False), state)


def test_an_interrupt_while_taking_the_plan_leaves_nothing_jammed(daemon, tmp_path, monkeypatch):
    """Ctrl-C (``KeyboardInterrupt``) raised while the first save reads the daemon's plan:
    the save raises it, holds no lock or reservation, and the next save goes through."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with daemon.client() as trainer:
        monkeypatch.setattr(stored_module, "plan_from_segment", interrupted)
        path = str(job / "step-2" / "model.pt")
        with pytest.raises(KeyboardInterrupt):
            trainer.save(model(2.0), path, durability="memory")
        monkeypatch.undo()
        state = model(4.0)
        trainer.save(state, path, durability="memory")  # plans afresh: asked once
        assert counts(trainer) == (0, 0, 1)
        assert equal(trainer.load(path, mmap=False), state)
        assert trainer.daemon_status() is not None


def _read_ahead_done(client) -> dict:
    thread = client._saves._ahead_thread
    assert thread is not None, "no plans read ahead"
    thread.join(30)
    return client._saves._ahead


def test_a_client_made_at_start_reads_the_kept_plans_ahead(daemon, tmp_path):
    """A client made in a process with torch reads the plans its user kept before its first
    save: the save only checks the one its key names, and saves its own state."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")
        earlier.save(model(1.0, count=3), str(job / "step-1" / "optim.pt"), durability="memory")
    with daemon.client() as trainer:
        assert len(_read_ahead_done(trainer)) == 2
        assert trainer._spares.warmed  # the spares are being mapped too
        state = model(6.0)
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(trainer) == (1, 1, 0)
        assert len(trainer._saves._ahead) == 1  # the other file's, still unchecked
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)


def test_a_plan_read_ahead_that_does_not_check_out_is_refused(daemon, tmp_path):
    """Read ahead, then written over in the segment before it was read: refused at the save,
    which plans afresh."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")
        _doctor(daemon, earlier, str(job / "step-1" / "model.pt"), b"adam", b"adan")
    with daemon.client() as trainer:
        assert len(_read_ahead_done(trainer)) == 1
        state = model(6.0)
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(trainer) == (0, 0, 1)
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)


def test_an_interrupt_while_reading_ahead_leaves_nothing_jammed(daemon, tmp_path, monkeypatch):
    """``KeyboardInterrupt`` raised inside the thread that reads plans ahead: the thread
    ends, the first save takes the plan itself, and ``close()`` returns."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(stored_module, "read_ahead", interrupted)
    monkeypatch.setattr("threading.excepthook", lambda args: None)  # the thread's end is quiet
    trainer = daemon.client()
    assert _read_ahead_done(trainer) == {}
    monkeypatch.undo()
    state = model(6.0)
    trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
    assert counts(trainer) == (1, 1, 0)
    assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)
    trainer.close()
    assert not trainer._saves._ahead_thread.is_alive()


def test_other_integers_plan_afresh_with_their_own_values(daemon, tmp_path):
    """The kept plan's skeleton holds step 1's integers: a state of the same structure with
    another step counter plans afresh (never the kept integers), and reloads its own."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        first = model(1.0)
        first["step"] = 100
        earlier.save(first, str(job / "step-1" / "model.pt"), durability="memory")
    with daemon.client() as trainer:
        state = model(2.0)
        state["step"] = 200
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(trainer) == (1, 0, 1)  # taken, then refused for its integers
        loaded = trainer.load(str(job / "step-2" / "model.pt"), mmap=False)
        assert loaded["step"] == 200 and equal(loaded, state)


def test_a_non_blocking_first_save_keeps_its_plan_for_the_next_job(daemon, tmp_path):
    """The plan of a non-blocking save is kept once that save is committed (on the save
    thread); the next job's blocking first save takes it."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        handle = earlier.save(model(1.0), str(job / "step-1" / "model.pt"), blocking=False)
        handle.wait()
    with daemon.client() as trainer:
        state = model(2.0)
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert counts(trainer) == (1, 1, 0)
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)
