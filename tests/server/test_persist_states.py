"""The persist-state table (:mod:`ckptcache.server.persist.states`): its shape, the one way a
state changes, and what an unlisted change does under the strict switch and without it."""

from __future__ import annotations

import ast
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptcache.server.metrics import Metrics
from ckptcache.server.persist.states import (
    STRICT_ENV,
    TRANSITIONS,
    PersistStates,
    UnlistedTransition,
    strict_from_env,
)
from ckptcache.wire.states import PersistState

PACKAGE = Path(__file__).resolve().parents[2] / "ckptcache"


@dataclass
class Gen:
    """The fields a transition changes (as on ``Generation``)."""

    path: str = "/ckpt/a.pt"
    number: int = 1
    persist_state: PersistState = PersistState.MEMORY_ONLY
    needs_persist: bool = True
    persisted: bool = False
    persist_error: str = ""


def _reachable(start: PersistState) -> set[PersistState]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_table_covers_every_state_and_names_only_states():
    assert set(TRANSITIONS) == set(PersistState)
    for targets in TRANSITIONS.values():
        assert set(targets) <= set(PersistState)


def test_every_state_is_reachable_from_a_new_generation():
    assert _reachable(PersistState.MEMORY_ONLY) == set(PersistState)


def test_persisted_is_the_only_terminal_state_and_every_state_can_still_end_persisted():
    terminal = {s for s, targets in TRANSITIONS.items() if not targets}
    assert terminal == {PersistState.PERSISTED}
    for state in PersistState:
        assert PersistState.PERSISTED in _reachable(state), state


def test_persisted_is_never_left_and_memory_only_never_returns():
    assert dict(TRANSITIONS[PersistState.PERSISTED]) == {}
    for state, targets in TRANSITIONS.items():
        assert PersistState.MEMORY_ONLY not in targets, state


def test_a_persist_is_written_only_by_a_worker_that_took_it_from_the_queue():
    into_persisting = {
        s for s, targets in TRANSITIONS.items() if PersistState.PERSISTING in targets
    }
    assert into_persisting == {PersistState.QUEUED}


def test_every_transition_has_a_one_line_reason():
    for state, targets in TRANSITIONS.items():
        for to, reason in targets.items():
            assert reason.strip() and "\n" not in reason, (state, to)


def test_a_listed_transition_applies_the_fields_given_with_it():
    states = PersistStates(Metrics(), strict=True)
    gen = Gen(persist_state=PersistState.PERSISTING, persist_error="earlier attempt")
    states.advance(gen, PersistState.PERSISTED, persisted=True, error="")
    assert (gen.persist_state, gen.persisted, gen.persist_error, gen.needs_persist) == (
        PersistState.PERSISTED, True, "", True,
    )  # fmt: skip
    gen = Gen(persist_state=PersistState.QUEUED)
    states.advance(gen, PersistState.DROPPED, needs_persist=False, error="deleted")
    assert (gen.persist_state, gen.needs_persist, gen.persist_error) == (
        PersistState.DROPPED, False, "deleted",
    )  # fmt: skip
    assert states.unlisted == 0


def test_an_unlisted_transition_raises_under_strict_and_changes_nothing():
    metrics = Metrics()
    states = PersistStates(metrics, strict=True)
    gen = Gen(persist_state=PersistState.PERSISTED, persisted=True, needs_persist=True)
    with pytest.raises(
        UnlistedTransition, match=re.escape("persisted -> queued of /ckpt/a.pt generation 1")
    ):
        states.advance(gen, PersistState.QUEUED, persisted=False, error="x")
    assert (gen.persist_state, gen.persisted, gen.persist_error) == (
        PersistState.PERSISTED, True, "",
    )  # fmt: skip
    assert states.unlisted == 1
    assert metrics.registry.get_sample_value("ckptcache_unlisted_persist_transitions_total") == 1.0


def test_an_unlisted_transition_in_production_is_applied_logged_and_counted(caplog):
    metrics = Metrics()
    states = PersistStates(metrics, strict=False)
    gen = Gen(persist_state=PersistState.MEMORY_ONLY)
    with caplog.at_level(logging.ERROR, logger="ckptcache.server.persist.states"):
        states.advance(gen, PersistState.PERSISTING)
    assert gen.persist_state == PersistState.PERSISTING  # the persist goes on
    assert states.unlisted == 1
    assert metrics.registry.get_sample_value("ckptcache_unlisted_persist_transitions_total") == 1.0
    assert any(
        r.levelno == logging.ERROR and "memory-only -> persisting" in r.getMessage()
        for r in caplog.records
    )


def test_the_strict_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    assert strict_from_env() and PersistStates().strict
    monkeypatch.setenv(STRICT_ENV, "0")
    assert not strict_from_env() and not PersistStates().strict
    monkeypatch.delenv(STRICT_ENV)
    assert not PersistStates().strict


def test_the_suite_runs_strict():
    assert strict_from_env(), f"tests/conftest.py sets {STRICT_ENV} for every process"


def _assigned_attributes(node: ast.AST) -> list[ast.Attribute]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    found, todo = [], targets
    while todo:
        target = todo.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            todo.extend(target.elts)
        elif isinstance(target, ast.Attribute):
            found.append(target)
    return found


def test_no_module_but_the_state_machine_assigns_persist_state():
    machine = PACKAGE / "server" / "persist" / "states.py"
    offenders = []
    for source in sorted(PACKAGE.rglob("*.py")):
        if source == machine:
            continue
        text = source.read_text()
        for node in ast.walk(ast.parse(text)):
            for attr in _assigned_attributes(node):
                if attr.attr == "persist_state":
                    offenders.append(f"{source.relative_to(PACKAGE.parent)}:{node.lineno}")
        if "setattr(" in text and '"persist_state"' in text:
            offenders.append(f"{source.relative_to(PACKAGE.parent)}: setattr")
    assert offenders == [], "assign persist_state only through PersistStates.advance"
