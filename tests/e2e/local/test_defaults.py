"""Safe by default: a save is persisted or refused at once, never silently memory-only; a save
that could never be written fails before any byte is copied; a budget full of checkpoints
that will never leave explains itself at once."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from ckptcache import Client
from ckptcache.cli.benchmarking import wait_for_socket
from ckptcache.errors import (
    BudgetExceeded,
    CkptCacheWarning,
    DaemonUnavailable,
    NameTooLong,
    ParentNotADirectory,
    PathIsADirectory,
    PathNotAllowed,
)
from tests.helpers import new_daemon
from tests.local_users import users

MiB = 1 << 20


@pytest.fixture
def default_daemon(tmp_path):
    """``start(*args)``: a root daemon run with its own defaults (no ``--memory-only``)."""
    started = []

    def start(*args: str):
        d = new_daemon(tmp_path, *args, defaults=True)
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.cleanup()


def test_a_root_daemon_refuses_a_save_it_could_never_persist(default_daemon, tmp_path):
    d = default_daemon("--memory-limit", "64MiB")
    path = tmp_path / "model.pt"
    with d.client(fallback="raise") as c:
        with pytest.raises(PathNotAllowed, match="--persist-root") as err:
            c.save({"w": torch.ones(4)}, path)
        assert "durability='memory'" in str(err.value)
        assert c.daemon_status().objects == 0  # refused before anything was held
        # Memory only is a choice the save can make: shown as such.
        c.save({"w": torch.ones(4)}, path, durability="memory")
        assert c.status(path).persist_state == "memory-only"
        assert torch.equal(c.load(path)["w"], torch.ones(4))
    assert not path.exists()
    assert "memory-only saves allowed" not in d.log()


def test_memory_only_for_a_whole_daemon_is_explicit_and_logged_once(default_daemon, tmp_path):
    d = default_daemon("--memory-limit", "64MiB", "--memory-only", "allow")
    with d.client() as c:
        c.save({"w": torch.ones(4)}, tmp_path / "a.pt")
        assert c.status(tmp_path / "a.pt").persist_state == "memory-only"
    assert d.log().count("memory-only saves allowed (--memory-only allow)") == 1


def test_a_memory_only_save_under_a_root_stays_memory_only_after_a_restart(
    default_daemon, tmp_path
):
    root = tmp_path / "ckpt"
    root.mkdir()
    d = default_daemon("--memory-limit", "64MiB", "--persist-root", str(root))
    path = root / "scratch.pt"
    with d.client() as c:
        c.save({"w": torch.ones(4)}, path, durability="memory")
        assert c.status(path).persist_state == "memory-only"
    d.restart()  # kill -9
    with d.client() as c:
        assert c.status(path).persist_state == "memory-only"
        assert torch.equal(c.load(path)["w"], torch.ones(4))
    assert not path.exists()


def _parent_is_a_file(path: Path) -> None:
    path.parent.rmdir()
    path.parent.write_bytes(b"x")


@pytest.mark.parametrize(
    ("make", "error", "builtin"),
    [
        (Path.mkdir, PathIsADirectory, IsADirectoryError),
        (_parent_is_a_file, ParentNotADirectory, NotADirectoryError),
        (None, NameTooLong, OSError),
    ],
    ids=["path-is-a-directory", "parent-is-a-file", "name-too-long"],
)
def test_a_save_that_could_never_be_written_fails_before_the_copy(
    default_daemon, tmp_path, make, error, builtin
):
    root = tmp_path / "ckpt"
    (root / "run").mkdir(parents=True)
    d = default_daemon("--memory-limit", "64MiB", "--persist-root", str(root))
    path = root / "run" / "iter1" / "model.pt"
    if make is None:
        path = root / "run" / ("x" * 300 + ".pt")
    else:
        (root / "run" / "iter1").mkdir()
        make(path)
    with d.client(fallback="raise") as c:
        with pytest.raises(error) as err:
            c.save({"w": torch.ones(4)}, path)
        assert isinstance(err.value, builtin)  # what torch.save would raise
        assert c.daemon_status().objects == 0


def test_a_budget_full_of_memory_only_checkpoints_says_so_at_once(default_daemon, tmp_path):
    d = default_daemon("--memory-limit", "24MiB", "--memory-only", "allow",
                       "--reserve-timeout", "600", "--pool-segments", "0")  # fmt: skip
    with d.client(fallback="raise", timeout=120) as c:
        for i in range(2):
            c.save({"w": torch.zeros(8 * MiB // 4)}, tmp_path / f"{i}.pt")
        with pytest.raises(BudgetExceeded) as err:
            c.save({"w": torch.zeros(8 * MiB // 4)}, tmp_path / "2.pt")
    message = str(err.value)
    assert "memory-only (never persisted)" in message and "0.pt" in message
    assert "ckptcache rm" in message
    assert "within" not in message  # refused at once, not after the reserve timeout


def test_a_daemon_running_as_a_user_persists_every_path_the_user_names(monkeypatch):
    """No root configured: a daemon running as an ordinary user persists any absolute path,
    and the kernel checks the user's permissions (a path the user may not write fails)."""
    user = users(1)[0]
    base = Path(tempfile.mkdtemp(prefix="ckptcache-user-", dir="/tmp"))
    os.chown(base, user.uid, user.gid)
    forbidden = Path(tempfile.mkdtemp(prefix="ckptcache-root-", dir="/tmp"))  # root's, 0700
    socket_path, shm = str(base / "d.sock"), f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:10]}"
    pid = _fork_daemon_as(user, socket_path, shm)
    monkeypatch.setenv("CKPTCACHE_DAEMON_UID", str(user.uid))  # trust the user's daemon
    try:
        wait_for_socket(socket_path, timeout=60)
        with Client(socket_path, fallback="raise") as c:
            path = base / "run" / "iter1" / "model.pt"
            c.save({"w": torch.arange(8.0)}, path)
            c.wait(path, timeout=60)
            assert c.status(path).persist_state == "persisted"
            with pytest.raises(PathNotAllowed, match="may not write") as err:
                c.save({"w": torch.ones(1)}, forbidden / "x.pt")
            assert isinstance(err.value, PermissionError)  # as torch.save would raise
        assert torch.equal(torch.load(path)["w"], torch.arange(8.0))
        assert path.stat().st_uid == user.uid
        assert not (forbidden / "x.pt").exists()
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(forbidden, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def _fork_daemon_as(user, socket_path: str, shm: str) -> int:
    """A daemon run by ``user`` in a forked child (the user cannot exec this interpreter)."""
    from ckptcache.server.config import load_config
    from ckptcache.server.daemon import run_daemon

    config = load_config(None, {"socket": socket_path, "shm_dir": shm, "memory_limit": 64 * MiB,
                                "persist_retries": 0, "pool_segments": 0})  # fmt: skip
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
            code = run_daemon(config)
        finally:
            os._exit(code)
    return pid


def test_a_path_with_dotdot_is_refused_not_cached(default_daemon, tmp_path):
    d = default_daemon("--memory-limit", "64MiB", "--memory-only", "allow")
    (tmp_path / "a").mkdir()
    with d.client() as c:
        for call in (
            lambda p: c.save({"w": torch.ones(1)}, p),
            lambda p: c.save({"w": torch.ones(1)}, p, durability="memory"),
            c.load,
            c.wait,
        ):
            with pytest.raises(PathNotAllowed, match=r"contains '\.\.'"):
                call(f"{tmp_path}/a/../x.pt")
        assert c.daemon_status().objects == 0


def test_wait_after_a_write_through_without_a_daemon_returns(tmp_path):
    path, other = tmp_path / "model.pt", tmp_path / "never-saved.pt"
    with Client(str(tmp_path / "no-daemon.sock")) as c:
        with pytest.warns(CkptCacheWarning, match="straight to storage"):
            c.save({"w": torch.arange(3.0)}, path)
        c.wait(path)  # the written-through file is complete: persisted
        c.wait()  # nothing of this client is pending
        with pytest.raises(DaemonUnavailable):
            c.wait(other)  # nothing says it is safe: never reported persisted
    assert torch.equal(torch.load(path)["w"], torch.arange(3.0))
