"""Generations that share memory, on a real daemon: an older checkpoint's pages equal to a newer
one's are given back to the system (holes in its segment file) and read from the newer one's
segment, and every load still returns the bytes that were saved: after a restart, after the
newer checkpoint is deleted, and never when the memory they were read from changed."""

from __future__ import annotations

import copy
import os
import random
import threading
import time

import pytest
import torch

from ckptcache.errors import CheckpointNotFound, CorruptCheckpoint
from tests.e2e.local.test_skip_unchanged import equal, lora, save_and_check, step
from tests.helpers import metric, wait_until


@pytest.fixture
def persisting(daemon_factory, tmp_path):
    return daemon_factory("--persist-root", str(tmp_path), "--metrics-port", "0")


def base_bytes(state: dict) -> int:
    """The frozen base's bytes, less the part pages that its storages share with the
    archive's records around them (only whole pages inside storages are shared)."""
    return int(0.95 * sum(t.untyped_storage().nbytes() for t in state["base"].values()))


def shared(d) -> float:
    return metric(d, "ckptcache_memory_shared_bytes") or 0.0


def resident(d, client, path: str) -> int:
    """Bytes of memory the segment file holding ``path`` has allocated."""
    return os.stat(os.path.join(d.segments_dir, client.status(path).segment)).st_blocks * 512


def save_steps(client, state: dict, root, count: int) -> dict[str, dict]:
    """Train and save under a new path each step (as the frameworks name checkpoints),
    each persisted; what each save held, by path."""
    saved = {}
    for i in range(count):
        step(state)
        path = str(root / "job" / f"iter_{i:07d}" / "model.pt")
        client.save(state, path)
        client.wait(path, timeout=60)
        saved[path] = copy.deepcopy(state)
    return saved


def test_checkpoints_of_later_steps_hold_the_frozen_base_once(persisting, tmp_path):
    state = lora()
    base = base_bytes(state)
    with persisting.client() as trainer:
        saved = save_steps(trainer, state, tmp_path, 3)
        paths = list(saved)
        wait_until(lambda: shared(persisting) >= 2 * base, 60, "the base shared")
        # The two older checkpoints' files hold hardly more than the adapters now.
        for path in paths[:2]:
            assert resident(persisting, trainer, path) < base // 4
        assert resident(persisting, trainer, paths[2]) >= base
        for path in paths:  # the oldest first: made whole from the newest's memory
            assert equal(trainer.load(path, mmap=False, verify=True), saved[path])
        assert equal(trainer.load(paths[0]), saved[paths[0]])
    assert (metric(persisting, 'ckptcache_corrupt_total{tier="local"}') or 0) == 0


def test_a_restart_rebuilds_the_sharing(persisting, tmp_path):
    state = lora()
    base = base_bytes(state)
    with persisting.client() as trainer:
        saved = save_steps(trainer, state, tmp_path, 3)
        wait_until(lambda: shared(persisting) >= 2 * base, 60, "the base shared")
    # Restarted with the comparison off: the sharing is rebuilt from the daemon's records.
    config = tmp_path / "no-sharing.yaml"
    config.write_text("share_pages: false\n")
    persisting.args = [*persisting.args, "--config", str(config)]
    persisting.restart()
    assert wait_until(lambda: shared(persisting), 30, "the metrics") >= 2 * base
    with persisting.client() as trainer:
        for path, held in saved.items():
            assert equal(trainer.load(path, mmap=False, verify=True), held)


def zero_base_bytes(d, client, path: str, state: dict, at: int) -> None:
    """Zero 64 bytes of the frozen base (``layer1`` from element ``at``) in the segment
    holding ``path`` on daemon ``d``: a write into committed memory."""
    segment = os.path.join(d.segments_dir, client.status(path).segment)
    needle = state["base"]["layer1"][at : at + 16].numpy().tobytes()
    with open(segment, "r+b") as f:
        f.seek(f.read().index(needle))
        f.write(bytes(len(needle)))


def two_steps_shared(d, client, root) -> tuple[dict, dict[str, dict], str, str]:
    """Two step checkpoints saved and persisted, the older one's base read from the newer's
    memory: (the live state, what each held, older path, newer path)."""
    state = lora()
    saved = save_steps(client, state, root, 2)
    wait_until(lambda: shared(d) >= base_bytes(state), 60, "the base shared")
    older, newer = list(saved)
    return state, saved, older, newer


def test_an_older_checkpoint_outlives_the_newer_one_holding_its_pages(persisting, tmp_path):
    with persisting.client() as trainer:
        _, saved, older, newer = two_steps_shared(persisting, trainer, tmp_path)
        assert trainer.delete(newer) == 1
        os.remove(newer)  # its memory and its file gone: only the older save's bytes remain
        assert equal(trainer.load(older, mmap=False, verify=True), saved[older])
        assert trainer.delete(older) == 1
    shared_dir = os.path.join(persisting.segments_dir, ".shared")
    assert os.listdir(shared_dir) == []
    assert shared(persisting) == 0


def test_pages_read_back_from_a_changed_newer_save_are_refused(persisting, tmp_path):
    """A write into the newer save's committed segment (its pages back the older save's):
    the older save, made whole from them, fails its digests, is dropped from memory and never
    served from it; the next load reads its persisted file."""
    with persisting.client() as trainer:
        state, saved, older, newer = two_steps_shared(persisting, trainer, tmp_path)
        zero_base_bytes(persisting, trainer, newer, state, at=1000)
        with pytest.raises(CorruptCheckpoint, match="read back from a newer save's memory"):
            trainer.load(older, mmap=False)
        with pytest.raises(CheckpointNotFound):  # dropped from memory already
            trainer.delete(older)
        assert equal(trainer.load(older, mmap=False), saved[older])  # its persisted file
    assert metric(persisting, 'ckptcache_corrupt_total{tier="local"}') >= 1
    assert equal(torch.load(older, weights_only=True), saved[older])


def test_an_unreadable_record_of_shared_pages_drops_the_checkpoint_at_restart(persisting, tmp_path):
    """After a kill -9, the record of where the older checkpoint's pages lie is garbage: the
    restarted daemon cannot make it whole, so it drops it rather than serve its holes; the
    load reads its persisted file, and the newer checkpoint is served from memory."""
    with persisting.client() as trainer:
        _, saved, older, newer = two_steps_shared(persisting, trainer, tmp_path)
    shared_dir = os.path.join(persisting.segments_dir, ".shared")
    (record,) = os.listdir(shared_dir)
    persisting.kill()
    with open(os.path.join(shared_dir, record), "wb") as f:
        f.write(b"\x00not json")
    persisting.restart()
    assert "or its record of where is unreadable" in persisting.log()
    with persisting.client() as trainer:
        assert "local" not in trainer.status(older).stages  # not in memory: never served
        assert equal(trainer.load(older, mmap=False, verify=True), saved[older])
        assert equal(trainer.load(newer, mmap=False, verify=True), saved[newer])
        assert trainer.status(newer).last_load_tier == "local"
    assert os.listdir(shared_dir) == []


def test_one_path_saved_again_and_again_shares_and_still_skips_the_base(persisting, tmp_path):
    """keep=2 of one path: the older generation shares the base with the newer; when it goes,
    its segment (with holes) is allocated and refilled before a save gets it, so saves go on
    skipping the unchanged base, and every load and the persisted file hold the bytes."""
    state = lora()
    base = base_bytes(state)
    path = str(tmp_path / "job" / "model.pt")
    with persisting.client() as trainer:
        for _ in range(3):
            step(state)
            save_and_check(trainer, state, path)
            trainer.wait(path, timeout=60)
        wait_until(lambda: shared(persisting) >= base, 60, "the base shared")
        kept_before = trainer._saves.unchanged.skipped
        for _ in range(6):
            step(state)
            save_and_check(trainer, state, path)
            trainer.wait(path, timeout=60)
        assert trainer._saves.unchanged.skipped > kept_before
        assert equal(trainer.load(path), state)
    assert equal(torch.load(path, weights_only=True), state)


def test_kill_9_at_random_points_of_sharing_loses_nothing(persisting, tmp_path):
    """A daemon killed at random moments: as the sharer compares and punches the steps just
    saved, and as a load copies an older step's pages back. After each restart every step
    loads bitwise, and none was ever refused: a crash never leaves pages that fail their
    digests (a record is written before the pages go, freed before they come back)."""
    rng = random.Random(47)
    state, saved = lora(), {}
    for round_ in range(5):
        with persisting.client() as trainer:
            saved.update(save_steps(trainer, state, tmp_path / f"r{round_}", 2))
        if round_ % 2:  # killed while a load makes the oldest step whole
            oldest = next(iter(saved))
            wait_until(lambda: shared(persisting) > 0, 60, "pages shared")

            def load(path: str = oldest) -> None:
                try:
                    with persisting.client() as c:
                        c.load(path, mmap=False)
                except Exception:  # the daemon killed under it: what it returned is not used
                    pass

            loader = threading.Thread(target=load)
            loader.start()
            time.sleep(rng.uniform(0, 0.05))
            persisting.kill()
            loader.join(30)
        else:  # killed while the sharer compares and punches
            time.sleep(rng.uniform(0, 0.3))
            persisting.kill()
        persisting.start()
        with persisting.client() as trainer:
            for path, held in saved.items():
                assert equal(trainer.load(path, mmap=False, verify=True), held), path
    assert "read back from a newer save's memory" not in persisting.log()
    assert "differs from its digest" not in persisting.log()
