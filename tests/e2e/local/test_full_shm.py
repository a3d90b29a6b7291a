"""A full shared-memory file system, filled by another process (any local user can fill
``/dev/shm``), at each step of a save: the daemon's shm directory lies on a small tmpfs of
the test's own. A save it cannot hold is written through (or, with ``fallback="raise"``,
refused with a typed error naming the file system); one it already reserved is committed,
digested and persisted; a restart adopts what it held; and nothing is left behind."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptcache.client._saves import Saves
from ckptcache.errors import BudgetExceeded, CkptCacheWarning
from tests.helpers import DaemonProc, assert_same, wait_until


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (0700, as the daemon wants its shm directory), unmounted afterwards."""
    shm = tmp_path / "shm"
    shm.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(shm)],
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield shm
    if subprocess.run(["umount", str(shm)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(shm)], check=False)  # a mapping still open


@pytest.fixture
def shm_daemon(
    small_shm: Path, daemon_factory: Callable[..., DaemonProc], tmp_path: Path
) -> DaemonProc:
    """A daemon whose shm directory is ``small_shm`` (stopped before it is unmounted)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    d = daemon_factory("--memory-limit", "1GiB", "--persist-root", str(root), start=False)
    d.shm_dir = str(small_shm)
    return d.start()


def fill(directory: Path) -> Path:
    """Another process's file, grown until the file system says ENOSPC (again, if called
    again: the daemon may have given some back meanwhile)."""
    filler = directory / "filler"
    block = b"\xab" * (1 << 20)
    with open(filler, "ab") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with contextlib.suppress(OSError), open(filler, "ab") as f:  # the last partial pages
        while True:
            f.write(b"\xab" * 4096)
            f.flush()
    return filler


def state(value: float, mib: int = 2) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib * 256, 1024), value), "step": torch.tensor(int(value))}


def nothing_left(d: DaemonProc) -> None:
    """No reservation open, every segment either free or holding a generation, and a record
    file only for the committed ones."""
    st = d.status()
    assert st.reservations == 0
    assert st.segments - st.free_segments == st.generations
    records = Path(d.segments_dir) / ".records"
    assert len(os.listdir(records)) == st.generations


def full_but_a_free_segment(c: Any, d: DaemonProc, root: Path) -> Path:
    """``a.pt`` committed, a free segment of its size (a deleted save's), and the file system
    full: a save of ``a.pt``'s size takes the free segment, whose record has no room."""
    c.save(state(1.0), str(root / "a.pt"))
    c.save(state(9.0), str(root / "gone.pt"), durability="memory")
    c.delete(str(root / "gone.pt"))
    return fill(Path(d.shm_dir))


def test_a_save_into_a_full_tmpfs_is_written_through(shm_daemon: DaemonProc, tmp_path: Path):
    """The record of a free segment's commit, then a new segment: neither has room."""
    root = tmp_path / "ckpt"
    with shm_daemon.client(timeout=20) as c:
        filler = full_but_a_free_segment(c, shm_daemon, root)
        for count, (name, mib) in enumerate((("b.pt", 2), ("c.pt", 8)), 1):
            fill(Path(shm_daemon.shm_dir))
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                c.save(state(2.0, mib), str(root / name))
            assert c.fallbacks == count  # warned once per cause: the first time
            assert count > 1 or any(str(shm_daemon.shm_dir) in str(w.message) for w in seen)
            assert c.status(str(root / name)).stages == ("storage",)
            assert_same(torch.load(root / name, weights_only=True), state(2.0, mib))
        nothing_left(shm_daemon)
        filler.unlink()
        c.save(state(3.0), str(root / "b.pt"))
        assert "local" in c.status(str(root / "b.pt")).stages
        assert_same(c.load(str(root / "b.pt")), state(3.0))
    nothing_left(shm_daemon)


def test_a_refused_save_names_the_file_system(shm_daemon: DaemonProc, tmp_path: Path):
    root = tmp_path / "ckpt"
    with shm_daemon.client(timeout=20, fallback="raise") as c:
        full_but_a_free_segment(c, shm_daemon, root)
        with pytest.raises(BudgetExceeded, match=f"{shm_daemon.shm_dir}.*No space left"):
            c.save(state(2.0), str(root / "b.pt"))
        assert not (root / "b.pt").exists()
        assert_same(c.load(str(root / "a.pt")), state(1.0))
    nothing_left(shm_daemon)


def test_a_tmpfs_filled_during_the_copy_still_commits_digests_and_persists(
    shm_daemon: DaemonProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Filled between the reservation and the commit: the segment's and its record's blocks
    were allocated with the reservation, so the commit, the digests and the persist all go
    through (the record's write used to fail with an internal error, the segment neither
    released nor indexed)."""
    root = tmp_path / "ckpt"
    mapping = Saves.mapping
    filled: list[Path] = []

    def mapping_then_fill(self: Saves, *args: Any) -> Any:
        found = mapping(self, *args)
        if not filled:
            filled.append(fill(Path(shm_daemon.shm_dir)))
        return found

    with shm_daemon.client(timeout=20, fallback="raise") as c:
        c.save(state(1.0), str(root / "a.pt"))
        monkeypatch.setattr(Saves, "mapping", mapping_then_fill)
        c.save(state(2.0), str(root / "b.pt"))
        monkeypatch.undo()
        assert filled
        st = c.status(str(root / "b.pt"))
        assert "local" in st.stages and st.generation == 1
        assert_same(c.load(str(root / "b.pt"), verify=True), state(2.0))
        c.wait(str(root / "b.pt"), timeout=30)
        assert c.status(str(root / "b.pt")).persist_state == "persisted"
        assert_same(torch.load(root / "b.pt", weights_only=True), state(2.0))
        wait_until(lambda: c.status(str(root / "b.pt")).digests_valid, timeout=10)
    nothing_left(shm_daemon)


def test_a_restart_on_a_full_tmpfs_adopts_what_it_held(shm_daemon: DaemonProc, tmp_path: Path):
    root = tmp_path / "ckpt"
    with shm_daemon.client(timeout=20) as c:
        c.save(state(1.0), str(root / "a.pt"), durability="memory")
        c.save(state(2.0), str(root / "m.pt"), durability="memory")
    fill(Path(shm_daemon.shm_dir))
    shm_daemon.restart()
    with shm_daemon.client(timeout=20) as c:
        assert_same(c.load(str(root / "a.pt"), verify=True), state(1.0))
        assert_same(c.load(str(root / "m.pt"), verify=True), state(2.0))
        with pytest.warns(CkptCacheWarning, match=str(shm_daemon.shm_dir)):
            c.save(state(3.0, 8), str(root / "c.pt"))
        assert_same(torch.load(root / "c.pt", weights_only=True), state(3.0, 8))
    nothing_left(shm_daemon)
