"""A job's first save takes its plan from the daemon's copy of an earlier save of the same file
(:mod:`ckptcache.codec.plan.stored`), even where that save is the trainer's first contact;
what it saves is the trainer's state, byte for byte, and a plan that does not decode to the
save's own structure is never used."""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict

import pytest
import torch

import ckptcache.codec.plan.stored as stored_module
from ckptcache.codec.plan.stored import plan_of_stored


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
    """Step 1's skeleton names another key than its tensor table (written over in the
    segment): the plan is refused, and the new save plans afresh with its own keys."""
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


def test_a_stored_plan_is_proven_against_what_it_decodes_to(daemon, tmp_path):
    """``plan_of_stored`` on a segment: the key of the object it decodes to; on a segment
    whose skeleton was written over, or that is no segment at all, nothing."""
    path = str(tmp_path / "job" / "step-1" / "model.pt")
    with daemon.client() as c:
        c.save(model(1.0), path, durability="memory")
        mapping, reply = c.map_local(path)
        proven = plan_of_stored(mapping, reply.manifest_offset, reply.manifest_size)
        assert proven is not None and proven.table
        from ckptcache.codec.plan.walk import walk

        walked = walk(model(5.0), versions=False)
        if walked is None:
            pytest.skip("the compiled walk is not built")
        assert proven.key == walked.key
        assert [i.key for i in proven.flat.infos] == [str(i) for i in range(40)]
        assert proven.flat.infos[0].name == "layers.0.weight"
        del mapping
        _doctor(daemon, c, path, b"adam", b"adan")
        mapping, reply = c.map_local(path)
        assert plan_of_stored(mapping, reply.manifest_offset, reply.manifest_size) is None
        assert plan_of_stored(mapping, 0, 16) is None


def test_an_interrupt_while_taking_the_plan_leaves_nothing_jammed(daemon, tmp_path, monkeypatch):
    """Ctrl-C (``KeyboardInterrupt``) raised while the first save proves the daemon's plan:
    the save raises it, holds no lock or reservation, and the next save goes through."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with daemon.client() as trainer:
        monkeypatch.setattr(stored_module, "_proven", interrupted)
        path = str(job / "step-2" / "model.pt")
        with pytest.raises(KeyboardInterrupt):
            trainer.save(model(2.0), path, durability="memory")
        monkeypatch.undo()
        state = model(4.0)
        trainer.save(state, path, durability="memory")  # plans afresh: asked once per name
        assert counts(trainer) == (0, 0, 1)
        assert equal(trainer.load(path, mmap=False), state)
        assert trainer.daemon_status() is not None
