"""A job's first save, planned while the job starts: a new trainer's first contact by a load or
an ``exists`` plans the structures of the job's earlier saves the daemon holds
(:mod:`ckptcache.client._plans`), so its first save of the same structure finds its plan made;
what it saves is the trainer's state, byte for byte, whatever the earlier save held."""

from __future__ import annotations

from collections import OrderedDict

import torch

from ckptcache.client._plans import job_prefix, newest_per_name
from ckptcache.wire import messages as m


def model(fill: float, count: int = 40) -> OrderedDict:
    state = OrderedDict(
        (f"layers.{i}.weight", torch.full((64, 16), fill + i)) for i in range(count)
    )
    state["shared"] = state["layers.0.weight"]  # a storage shared by two names
    return state


def planned(client) -> list[str]:
    """The earlier saves the client planned ahead, once its thread is done."""
    warmer = client._parts.plans
    thread = warmer._thread
    assert thread is not None, "no planning ahead started"
    thread.join(30)
    return warmer.planned


def plan_counts(client) -> tuple[int, int]:
    plans = client._saves._plans
    return (plans.hits, plans.misses) if plans is not None else (0, 0)


def equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_first_save_of_a_new_trainer_finds_its_plan_made(daemon, tmp_path):
    """An earlier trainer saved step 1; a new one checks for step 2 (``exists``), then saves
    step 2 with other bytes: its first save reuses the plan made from step 1's structure, and
    the reload is the new state, not step 1's."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")
    with daemon.client() as trainer:
        assert not trainer.exists(str(job / "step-2" / "model.pt"))
        assert planned(trainer) == [str(job / "step-1" / "model.pt")]
        state = model(7.0)
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        # The plan made ahead, taken from step 1's copy (a hit), then the save's hit.
        assert plan_counts(trainer) == (2, 0)
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)


def test_another_structure_plans_afresh(daemon, tmp_path):
    """A first save of a structure other than the earlier save's is planned afresh, and is
    its own bytes."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")
    with daemon.client() as trainer:
        trainer.exists(str(job / "step-2" / "model.pt"))
        planned(trainer)
        state = model(3.0, count=41)
        trainer.save(state, str(job / "step-2" / "model.pt"), durability="memory")
        assert plan_counts(trainer) == (1, 1)  # step 1's plan, then the save's own
        assert equal(trainer.load(str(job / "step-2" / "model.pt"), mmap=False), state)


def test_a_save_as_first_contact_plans_nothing_ahead(daemon, tmp_path):
    """A save that is the client's first contact is not slowed by planning beside it."""
    job = tmp_path / "job"
    with daemon.client() as earlier:
        earlier.save(model(1.0), str(job / "step-1" / "model.pt"), durability="memory")
    with daemon.client() as trainer:
        trainer.save(model(2.0), str(job / "step-2" / "model.pt"), durability="memory")
        trainer.exists(str(job / "step-2" / "model.pt"))
        assert trainer._parts.plans._thread is None
        # Its plan taken from step 1's copy instead (tests/e2e/local/test_stored_plans.py).
        assert plan_counts(trainer) == (1, 0)


def test_the_job_prefix_and_the_newest_save_of_each_file_name():
    assert job_prefix("/ckpt/job/step-100/model.pt") == "/ckpt/job/"
    assert job_prefix("/model.pt") == "/"

    def info(path: str, committed: float) -> m.ObjectInfo:
        return m.ObjectInfo("default", path, 1, 1, ("memory",), committed, "s", 0, True)

    objects = [
        info("/j/step-1/model.pt", 1.0),
        info("/j/step-2/model.pt", 2.0),
        info("/j/step-1/optim.pt", 1.5),
    ]
    assert [o.path for o in newest_per_name(objects)] == [
        "/j/step-2/model.pt",
        "/j/step-1/optim.pt",
    ]
    assert len(newest_per_name([info(f"/j/s/{i}.pt", i) for i in range(9)])) == 4


def test_planning_ahead_is_not_a_load_of_the_path(daemon, tmp_path):
    """The plans read ahead from the job's saves are the client's own doing: a file it
    planned but its user never loaded has no load recorded (``status`` says where a load of
    the user's was served from, never the client's reading ahead)."""
    job = tmp_path / "job" / "step-1"
    model_path, optim_path = str(job / "model.pt"), str(job / "optim.pt")
    with daemon.client() as earlier:
        earlier.save(model(1.0), model_path, durability="memory")
        earlier.save(model(2.0, count=8), optim_path, durability="memory")
    with daemon.client() as trainer:
        assert equal(trainer.load(model_path), model(1.0))  # first contact: plans ahead
        assert sorted(planned(trainer)) == sorted([model_path, optim_path])
        assert trainer.status(optim_path).last_load_tier == ""  # never loaded
        assert trainer.status(model_path).last_load_tier == "local"
