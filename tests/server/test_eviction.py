"""The eviction policy (:mod:`ckptcache.server.memory.eviction`): which generations may leave memory,
in which order, and what is protected (pinned, the newest unpersisted save, another user's
unpersisted generation, anything storage has not received beyond ``keep``)."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from ckptcache.server.memory.arena import Arena
from ckptcache.server.memory.eviction import EvictionPolicy
from ckptcache.server.memory.index import Generation, Index
from ckptcache.server.memory.shares import Shares
from ckptcache.server.ownership import Saver
from ckptcache.server.persist.states import PersistStates
from ckptcache.wire.states import PersistState

ME = os.geteuid()
OTHER = ME + 4242


@pytest.fixture
def arena():
    shm = f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:8]}"
    yield Arena(shm, 64 << 20, 0o700)
    shutil.rmtree(shm, ignore_errors=True)


def _gen(path: str, number: int, committed: float, *, uid: int = ME, **fields) -> Generation:
    """A committed generation's record (the policy reads no segment)."""
    gen = Generation("default", path, number, None, None, size=0, committed=committed,  # type: ignore[arg-type]
                     saver=Saver(uid, uid, 0o022), needs_persist=True)  # fmt: skip
    for name, value in fields.items():
        setattr(gen, name, value)
    return gen


def _persisted(gen: Generation) -> Generation:
    states = PersistStates(strict=True)
    states.advance(gen, PersistState.QUEUED)
    states.advance(gen, PersistState.PERSISTING)
    states.advance(gen, PersistState.PERSISTED, persisted=True)
    return gen


def _index(*gens: Generation) -> Index:
    index = Index()
    for gen in gens:
        index.add(gen)
    return index


def test_candidates_go_oldest_commit_first_across_paths(arena):
    policy = EvictionPolicy(Shares(arena, None, ()))
    a1, a2 = _gen("/a", 1, 10.0), _persisted(_gen("/a", 2, 40.0))
    b1, b2 = _gen("/b", 1, 5.0), _persisted(_gen("/b", 2, 30.0))
    c1, c2 = _gen("/c", 1, 20.0), _gen("/c", 2, 50.0)
    index = _index(a1, a2, b1, b2, c1, c2)
    assert policy.candidates(index) == [b1, a1, c1, b2, a2]


def test_the_newest_unpersisted_save_of_a_path_is_protected_unless_orphaned(arena):
    policy = EvictionPolicy(Shares(arena, None, ()))
    newest = _gen("/a", 1, 1.0)
    assert (
        policy.protection(newest, newest=True) == "the newest save of its path, not persisted yet"
    )
    assert policy.candidates(_index(newest)) == []
    newest.orphaned = True  # its directory was removed: never persisted, evictable
    assert policy.protection(newest, newest=True) == ""
    assert policy.candidates(_index(newest)) == [newest]


def test_a_memory_only_newest_save_is_protected_too(arena):
    policy = EvictionPolicy(Shares(arena, None, ()))
    memory_only = _gen("/m", 1, 1.0, needs_persist=False)
    assert policy.candidates(_index(memory_only)) == []


def test_pinned_generations_are_never_candidates_persisted_or_not(arena):
    policy = EvictionPolicy(Shares(arena, None, ()))
    old = _gen("/a", 1, 1.0, pins=1)
    done = _persisted(_gen("/a", 2, 2.0, pins=2))
    assert policy.protection(old, newest=False) == "pinned"
    assert policy.protection(done, newest=True) == "pinned"
    assert policy.candidates(_index(old, done)) == []


def test_a_save_never_evicts_another_users_unpersisted_generation(arena):
    policy = EvictionPolicy(Shares(arena, None, (OTHER,)))
    theirs_old = _gen("/theirs", 1, 1.0, uid=OTHER)
    theirs_done = _persisted(_gen("/theirs", 2, 2.0, uid=OTHER))
    theirs_orphan = _gen("/gone", 1, 3.0, uid=OTHER, orphaned=True)
    mine_old, mine_new = _gen("/mine", 1, 4.0), _gen("/mine", 2, 5.0)
    index = _index(theirs_old, theirs_done, theirs_orphan, mine_old, mine_new)
    assert policy.victims(index, ME) == [theirs_done, theirs_orphan, mine_old]
    assert policy.victims(index, OTHER) == [theirs_old, theirs_done, theirs_orphan]
    # Back under its share, a user gives up only its own, persisted or not.
    assert policy.own_victims(index, ME) == [mine_old]
    assert policy.own_victims(index, OTHER) == [theirs_old, theirs_done, theirs_orphan]


def test_without_admitted_users_any_candidate_may_go(arena):
    policy = EvictionPolicy(Shares(arena, None, ()))
    other = _gen("/theirs", 1, 1.0, uid=OTHER)
    newer = _gen("/theirs", 2, 2.0, uid=OTHER)
    assert policy.victims(_index(other, newer), ME) == [other]


def test_keep_never_retires_what_storage_has_not_received(arena):
    policy = EvictionPolicy(Shares(arena, None, ()))
    assert not policy.may_retire_beyond_keep(_gen("/a", 1, 1.0))
    assert policy.may_retire_beyond_keep(_persisted(_gen("/a", 1, 1.0)))
    assert policy.may_retire_beyond_keep(_gen("/a", 1, 1.0, needs_persist=False))


def test_only_a_persist_still_under_way_frees_memory_by_waiting(arena):
    policy = EvictionPolicy(Shares(arena, None, ()))
    states = PersistStates(strict=True)
    gen = _gen("/a", 1, 1.0)
    assert policy.on_its_way(gen)
    states.advance(gen, PersistState.QUEUED)
    states.advance(gen, PersistState.PERSISTING)
    assert policy.on_its_way(gen)
    states.advance(gen, PersistState.FAILED)
    assert not policy.on_its_way(gen)
    conflict = _gen("/b", 1, 1.0)
    states.advance(conflict, PersistState.CONFLICT)
    assert not policy.on_its_way(conflict)
    assert not policy.on_its_way(_persisted(_gen("/c", 1, 1.0)))
    assert not policy.on_its_way(_gen("/m", 1, 1.0, needs_persist=False))
