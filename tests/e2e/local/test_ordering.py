"""README "Guarantees": newest wins whatever the clocks say, and deleted stays deleted.

Real daemons sharing one storage root, their clocks shifted by ``libfaketime`` (Debian's
``faketime``) as on a cluster whose NTP stepped or whose VM resumed from suspend; kill -9
between a drop and its sweep; directories removed while the daemon is down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from ckptcache.errors import CheckpointDeleted, PersistConflict
from tests.e2e.local.test_guarantees import blob, idle
from tests.e2e.local.test_persist import config
from tests.helpers import read_only_dir, wait_until

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


#: libfaketime's ``clock_nanosleep`` fails with EINVAL for the absolute monotonic deadline
#: Python's ``time.sleep`` uses (0.9.10, monotonic clock not faked); every other wait works.
#: The skewed daemon sleeps through ``select`` instead: only the tool is worked around, the
#: daemon's clock is really off.
_SLEEP_SHIM = "import select, time\ntime.sleep = lambda s: select.select([], [], [], max(0.0, s))\n"


def skewed(offset: str | None, shim_dir) -> dict[str, str]:
    """The environment of a daemon whose wall clock is ``offset`` off (``"+1h"``, ``"-1h"``)."""
    if offset is None:
        return {}
    assert os.path.exists(LIBFAKETIME), "Debian's faketime package is needed (scripts/setup.sh)"
    shim_dir.mkdir(exist_ok=True)
    (shim_dir / "sitecustomize.py").write_text(_SLEEP_SHIM)
    return {
        "LD_PRELOAD": LIBFAKETIME, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": os.pathsep.join([str(shim_dir), *sys.path]),
    }  # fmt: skip


# ----------------------------------------------------------------- clocks


@pytest.mark.parametrize(
    ("first", "second"),
    [("+1h", None), (None, "-1h")],
    ids=["first-writer-an-hour-ahead", "second-writer-an-hour-behind"],
)
def test_the_later_save_wins_on_storage_whatever_the_clocks(
    daemon_factory, tmp_path, first, second
):
    root = tmp_path / "ckpt"
    root.mkdir()
    cfg = config(tmp_path)
    a = daemon_factory(
        "--persist-root", str(root), "--config", cfg, env=skewed(first, tmp_path / "shim")
    )
    b = daemon_factory(
        "--persist-root", str(root), "--config", cfg, env=skewed(second, tmp_path / "shim")
    )
    path = root / "model.pt"
    with a.client() as c:
        c.save(blob(1, 1), path)
        c.wait(path)
    # The clocks really disagree: the later save carries the earlier wall-clock time.
    with b.client() as c:
        c.save(blob(1, 2), path)
        c.wait(path)  # returns only once step 2 is on storage
        st = c.status(path)
        assert st.persist_state == "persisted" and "persisted" in st.stages
    assert torch.load(path)["step"] == 2
    with a.client() as c:  # and every load agrees, on both nodes
        assert c.load(path)["step"] == 2
    with b.client() as c:
        assert c.load(path)["step"] == 2


def test_saves_that_only_clocks_could_order_are_a_conflict_never_a_silent_loss(
    daemon_factory, tmp_path
):
    """Both nodes save the path before either persisted: whichever lands second is not
    written, and its wait() raises PersistConflict instead of saying persisted."""
    root = tmp_path / "ckpt"
    target = root / "iter_1"
    target.mkdir(parents=True)
    cfg = config(tmp_path, persist_retries=200, persist_backoff=0.05, persist_backoff_max=0.1)
    a = daemon_factory(
        "--persist-root", str(root), "--config", cfg, env=skewed("+1h", tmp_path / "shim")
    )
    b = daemon_factory("--persist-root", str(root), "--config", cfg)
    path = target / "model.pt"
    with a.client() as ca, b.client() as cb:
        with read_only_dir(target):  # neither can persist yet
            ca.save(blob(1, 1), path)
            cb.save(blob(1, 2), path)
            wait_until(lambda: ca.status(path).persist_error and cb.status(path).persist_error)
        outcomes = {}
        for name, c in (("a", ca), ("b", cb)):
            try:
                c.wait(path, timeout=60)
                outcomes[name] = "persisted"
            except PersistConflict as e:
                assert "only wall clocks could tell which is newer" in str(e)
                outcomes[name] = "conflict"
                assert c.status(path).persist_state == "conflict"
        assert sorted(outcomes.values()) == ["conflict", "persisted"]
        winner = 1 if outcomes["a"] == "persisted" else 2
        assert torch.load(path)["step"] == winner  # the conflicting save replaced nothing
        loser = b if winner == 1 else a
        listing = subprocess.run(
            [sys.executable, "-m", "ckptcache.cli", "ls", "--socket", loser.socket, str(root)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "conflict" in listing


def test_restart_never_persists_a_skewed_older_save_over_a_newer_write_through(
    daemon_factory, tmp_path
):
    root = tmp_path / "ckpt"
    target = root / "iter_1"
    target.mkdir(parents=True)
    cfg = config(tmp_path, persist_retries=100, persist_backoff=0.1, persist_backoff_max=0.2)
    d = daemon_factory(
        "--persist-root", str(root), "--config", cfg, env=skewed("+1h", tmp_path / "shim")
    )
    path = target / "model.pt"
    with read_only_dir(target):
        with d.client() as c:
            c.save(blob(1, 1), path)  # stamped an hour ahead; cannot be persisted yet
            wait_until(lambda: c.status(path).persist_error)
        d.kill()
    torch.save(blob(1, 2), path)  # written through while the daemon is down
    d.env = {}  # the clock was fixed meanwhile
    d.start()
    with d.client() as c:
        wait_until(lambda: idle(c))
        assert c.load(path)["step"] == 2
    assert torch.load(path)["step"] == 2


# ----------------------------------------------------------------- deleted stays deleted


@pytest.fixture
def full_storage(tmp_path):
    """A storage root on its own tmpfs, too small for a 1 MiB checkpoint (``remount`` it
    with ``size=64m`` to free the space)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], check=True)
    yield root
    subprocess.run(["umount", "-l", str(root)], check=True)


def _free(root) -> None:
    subprocess.run(["mount", "-o", "remount,size=64m", str(root)], check=True)


def _failing_persist(daemon_factory, tmp_path, root):
    """A daemon whose persist of ``job/iter1/model.pt`` keeps failing (storage full), and
    that path, saved."""
    iter1 = root / "job" / "iter1"
    iter1.mkdir(parents=True)
    cfg = config(tmp_path, persist_retries=1000, persist_backoff=0.05, persist_backoff_max=0.1,
                 orphan_sweep=0)  # fmt: skip
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    path = iter1 / "model.pt"
    with d.client() as c:
        c.save(blob(1, 1), path)
        wait_until(lambda: "No space left" in c.status(path).persist_error)
    return d, iter1, path


def _assert_stays_deleted(d, iter1, path) -> None:
    with d.client() as c:
        with pytest.raises(CheckpointDeleted):
            c.wait(path, timeout=30)
        assert c.status(path).persist_state == "dropped"
        wait_until(lambda: idle(c))
    assert not os.path.exists(path)


def test_a_dropped_checkpoint_stays_deleted_after_kill_9(daemon_factory, tmp_path, full_storage):
    d, iter1, path = _failing_persist(daemon_factory, tmp_path, full_storage)
    shutil.rmtree(iter1)  # the user's rotation deletes the checkpoint
    with d.client() as c, pytest.raises(CheckpointDeleted):
        c.wait(path, timeout=30)
    d.kill()  # kill -9 before any sweep freed it
    _free(full_storage)
    d.start()
    _assert_stays_deleted(d, iter1, path)
    assert not iter1.exists()  # never recreated


def test_a_directory_removed_while_the_daemon_is_down_is_never_recreated(
    daemon_factory, tmp_path, full_storage
):
    d, iter1, path = _failing_persist(daemon_factory, tmp_path, full_storage)
    d.kill()
    shutil.rmtree(iter1)
    _free(full_storage)
    d.start()
    _assert_stays_deleted(d, iter1, path)
    assert not iter1.exists()
    assert (full_storage / "job").is_dir()


def test_a_dropped_checkpoint_stays_deleted_when_its_directory_comes_back(
    daemon_factory, tmp_path, full_storage
):
    d, iter1, path = _failing_persist(daemon_factory, tmp_path, full_storage)
    shutil.rmtree(iter1)
    with d.client() as c, pytest.raises(CheckpointDeleted):
        c.wait(path, timeout=30)
    d.kill()
    iter1.mkdir()  # a new run reuses the directory name
    _free(full_storage)
    d.start()
    _assert_stays_deleted(d, iter1, path)
    assert list(iter1.iterdir()) == []
