"""A clean stop gives a stopped daemon's memory back: persisted checkpoints are on storage,
so their segments go; unpersisted ones stay for the next start (``--keep-on-stop`` keeps all).
"""

from __future__ import annotations

import os
import signal

import torch

from tests.e2e.local.test_persist import config
from tests.helpers import assert_same, read_only_dir, wait_until

MiB = 1 << 20


def blob(mib: float, seed: int) -> dict:
    return {"w": torch.full((int(mib * MiB) // 4,), float(seed)), "step": seed}


def segment_files(d) -> list[str]:
    """Segment files left in the daemon's shm directory (records are dot-files)."""
    found = []
    for where, dirs, names in os.walk(d.segments_dir):
        dirs[:] = [n for n in dirs if not n.startswith(".")]
        found += [os.path.join(where, n) for n in names if n.startswith("seg-")]
    return found


def three_saves(d, root, tmp_path):
    """A persisted save, one whose persist is failing (``root/stuck`` is read-only), one
    memory-only: their paths."""
    persisted, failing = root / "done" / "model.pt", root / "stuck" / "model.pt"
    persisted.parent.mkdir(parents=True)
    memory = tmp_path / "scratch" / "model.pt"  # under no persist root
    with d.client() as c:
        c.save(blob(2, 1), persisted)
        c.wait(persisted, timeout=60)
        c.save(blob(3, 2), failing)
        wait_until(lambda: c.status(failing).persist_error)
        c.save(blob(4, 3), memory)
        wait_until(lambda: d.status().spare_segments > 0)  # spares are made too
    return persisted, failing, memory


def test_a_clean_stop_gives_back_persisted_memory_and_keeps_the_rest(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    cfg = config(tmp_path, persist_retries=1000, persist_backoff=0.2, persist_backoff_max=0.2)
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    root.mkdir()
    (root / "stuck").mkdir()
    with read_only_dir(root / "stuck"):
        persisted, failing, memory = three_saves(d, root, tmp_path)
        assert len(segment_files(d)) >= 4  # three generations and a spare at least
        d.kill(signal.SIGTERM)
        assert d.proc is not None and d.proc.returncode == 0
        left = segment_files(d)
        assert len(left) == 2, left  # the unpersisted two
        assert sum(os.path.getsize(p) for p in left) < 12 * MiB
        assert "released 1 persisted generation(s)" in d.log()
        d.start()
        with d.client() as c:
            assert c.status(persisted).stages == ("storage",)
            assert_same(blob(2, 1), c.load(persisted))  # from storage
            assert_same(blob(4, 3), c.load(memory))
            assert_same(blob(3, 2), c.load(failing))
            assert c.status(failing).persist_state == "persisting"
    with d.client() as c:
        c.wait(failing, timeout=60)  # its directory is writable again: persisted after all
    assert torch.load(failing)["step"] == 2


def test_keep_on_stop_keeps_every_checkpoint_for_the_next_start(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    cfg = config(tmp_path, persist_retries=1000, persist_backoff=0.2, persist_backoff_max=0.2)
    d = daemon_factory("--persist-root", str(root), "--config", cfg, "--keep-on-stop")
    root.mkdir()
    (root / "stuck").mkdir()
    with read_only_dir(root / "stuck"):
        persisted, failing, memory = three_saves(d, root, tmp_path)
        d.kill(signal.SIGINT)
        assert len(segment_files(d)) == 3  # the spares go, every generation stays
        d.start()
        with d.client() as c:
            assert c.status(persisted).stages == ("local", "persisted")
            for path, want in (
                (persisted, blob(2, 1)),
                (failing, blob(3, 2)),
                (memory, blob(4, 3)),
            ):
                assert_same(want, c.load(path))
