"""README "Guarantees": never stale, never lost, and what the user deleted stays deleted.

Real daemons, real faults: kill -9, a stopped daemon dropping a client's connection, a raw
malformed commit, removed directories.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

from ckptcache.errors import (
    BudgetExceeded,
    CheckpointDeleted,
    CheckpointNotFound,
    CkptCacheWarning,
    ProtocolMismatch,
)
from ckptcache.wire import messages as m
from tests.e2e.local.test_persist import config
from tests.helpers import assert_same, read_only_dir, wait_until

MiB = 1 << 20


def blob(mib: float, seed: int) -> dict:
    """An object of about ``mib`` MiB whose content names its seed."""
    return {"w": torch.full((int(mib * MiB) // 4,), float(seed)), "step": seed}


def idle(client) -> bool:
    """No generation waits for, or is in, a persist."""
    busy = ("queued", "persisting")
    return all(o.persist_state not in busy for o in client.list(all_namespaces=True))


def remove_tree(path, attempts: int = 20) -> None:
    """``shutil.rmtree`` as a user would run it next to a writer: a file renamed into the
    directory while rmtree runs makes it fail with ENOTEMPTY (as with any concurrent writer);
    running it again removes the directory, which then never comes back."""
    for _ in range(attempts - 1):
        try:
            shutil.rmtree(path)
            return
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise
    shutil.rmtree(path)


# ----------------------------------------------------------------- 1. write-through wins


@pytest.mark.parametrize("under_root", [True, False], ids=["persisted", "memory-only"])
def test_write_through_save_wins_over_the_memory_copy(daemon_factory, tmp_path, under_root):
    root, other = tmp_path / "ckpt", tmp_path / "scratch"
    root.mkdir(), other.mkdir()
    d = daemon_factory("--memory-limit", "16MiB", "--persist-root", str(root))
    path = (root if under_root else other) / "model.pt"
    with d.client() as c:
        c.save(blob(1, 1), path)
        if under_root:
            c.wait(path)
        with pytest.warns(CkptCacheWarning, match="straight to storage"):
            c.save(blob(20, 2), path)  # larger than the whole budget: written through
        assert c.load(path)["step"] == 2
        assert c.status(path).stages == ("storage",)  # the memory copy was retired
        c.wait(path)  # nothing left to wait for: it is on storage
    assert torch.load(path)["step"] == 2


# ----------------------------------------------------------------- 2. newest wins on storage


def test_restart_never_persists_an_older_generation_over_a_newer_file(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    target = root / "iter_1"
    target.mkdir(parents=True)
    cfg = config(tmp_path, persist_retries=100, persist_backoff=0.1, persist_backoff_max=0.2)
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    path = target / "model.pt"
    with read_only_dir(target):
        with d.client() as c:
            c.save(blob(1, 1), path)  # v1 cannot be persisted yet
            wait_until(lambda: c.status(path).persist_error)
        d.kill()  # kill -9 with v1 only in memory
    with d.client() as c, pytest.warns(CkptCacheWarning):
        c.save(blob(1, 2), path)  # no daemon: v2 is written through, as documented
    assert torch.load(path)["step"] == 2
    d.start()  # recovers v1's segment: it must not go over v2
    with d.client() as c:
        assert c.load(path)["step"] == 2
        assert c.status(path).stages == ("storage",)
        assert idle(c)
    assert torch.load(path)["step"] == 2
    assert f"dropping {path} generation 1: storage holds a newer object" in d.log()


def test_a_save_superseded_by_a_write_by_hand_says_superseded_until_saved_again(
    daemon_factory, tmp_path
):
    root = tmp_path / "ckpt"
    target = root / "iter_1"
    target.mkdir(parents=True)
    path = target / "model.pt"
    torch.save(blob(0.1, 0), path)  # the file the save finds (its base)
    cfg = config(tmp_path, persist_retries=100, persist_backoff=0.1, persist_backoff_max=0.2)
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    with d.client() as c:
        with read_only_dir(target):  # the persist cannot create its temporary file yet
            c.save(blob(1, 1), path)
            wait_until(lambda: c.status(path).persist_error)
            torch.save(blob(0.2, 9), path)  # overwritten in place by hand: the newer write
        c.wait(path, timeout=60)
        st = c.status(path)
        assert (st.persist_state, st.generation, st.stages) == ("superseded", 1, ())
        assert "replaced on storage after this save" in st.persist_error
        assert [o.path for o in c.list()] == []  # nothing of it is held
        assert c.load(path)["step"] == 9  # the hand-written file
        assert c.status(path).persist_state == "superseded"  # a load is not a newer save
    with d.client() as c:  # another connection is told the same
        assert c.status(path).persist_state == "superseded"
        c.save(blob(1, 2), path)  # a newer save replaces the record
        c.wait(path, timeout=60)
        st = c.status(path)
        assert (st.persist_state, st.generation) == ("persisted", 2)
    assert torch.load(path)["step"] == 2


def test_persist_stamps_the_commit_time_and_skips_a_newer_file(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    d = daemon_factory("--persist-root", str(root), "--config", config(tmp_path))
    path = root / "model.pt"
    with d.client() as c:
        c.save(blob(1, 1), path)
        c.wait(path)
        stamped = os.stat(path).st_mtime_ns
        assert abs(stamped / 1e9 - c.status(path).committed) < 1e-3  # the node's commit time
        assert c.load(path)["step"] == 1


# ----------------------------------------------------------------- 3. zero-copy pins


def test_zero_copy_tensors_survive_a_dropped_connection(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "24MiB", "--keep", "1")
    path = tmp_path / "weights.pt"
    loader = d.client(timeout=2)
    with d.client(fallback="raise") as saver:
        saver.save(blob(8, 1), path)
        w = loader.load(path)["w"]  # zero copy: a view of generation 1's segment
        # The connection goes while the tensor lives (as after a request timeout): the
        # daemon lets go of every pin the connection held.
        loader.close()
        wait_until(lambda: d.status().pinned == 0)  # the daemon let the connection's pins go
        for seed in range(2, 6):  # later saves need memory: generation 1's segment is free
            saver.save(blob(8, seed), path)
        assert saver.load(path)["step"] == 5
    assert torch.equal(w, torch.full_like(w, 1.0))  # the trainer's tensor never changed
    del w


def test_a_save_waiting_for_memory_answers_within_the_client_timeout(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "24MiB", "--reserve-timeout", "600")
    with d.client() as holder, d.client(timeout=3, fallback="raise") as c:
        holder.save(blob(8, 1), tmp_path / "a.pt")
        held = holder.load(tmp_path / "a.pt")  # pinned: not evictable
        holder.save(blob(8, 2), tmp_path / "b.pt")
        held2 = holder.load(tmp_path / "b.pt")
        with pytest.raises(BudgetExceeded):  # not DaemonUnavailable: the daemon answered
            c.save(blob(8, 3), tmp_path / "c.pt")
        del held, held2


# ----------------------------------------------------------------- 4. failed commits


def test_a_malformed_commit_frees_its_reservation(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "64MiB", "--reserve-timeout", "1")
    path = str(tmp_path / "x.pt")
    with d.client(fallback="raise") as c:
        for _ in range(5):
            reply = c._connection.call(
                "reserve", m.ReserveRequest(c.namespace, path, 11 * MiB), m.ReserveReply
            )
            raw = {"reservation": reply.reservation, "manifest_offset": 4096.5,
                   "manifest_size": 100, "stall_seconds": 0.0}  # fmt: skip
            answer = json.loads(c._connection.rpc.root.request("commit", json.dumps(raw)))
            assert answer["error"]["type"] == "ProtocolMismatch"
            assert "manifest_offset: must be int, not float" in answer["error"]["message"]
        assert d.status().objects == 0
        c.save(blob(11, 7), path)  # the five refused commits hold nothing
        c.save(blob(11, 8), tmp_path / "y.pt")
        assert c.load(path)["step"] == 7


def test_commit_fields_are_type_checked():
    good = m.encode(m.CommitRequest(1, 4096, 10))
    assert m.decode(m.CommitRequest, good) == m.CommitRequest(1, 4096, 10)
    for field, bad in (("manifest_offset", 4096.5), ("reservation", "1"), ("manifest_size", True)):
        body = {**json.loads(good), field: bad}
        with pytest.raises(ProtocolMismatch, match=f"CommitRequest.{field}: "):
            m.decode(m.CommitRequest, json.dumps(body))
    assert m.decode(m.WaitRequest, '{"namespace":"n","path":"p","timeout":3}').timeout == 3


# ----------------------------------------------------------------- 5. wait after a restart


def test_wait_after_a_restart_returns_for_a_persisted_path(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    d = daemon_factory("--persist-root", str(root), "--config", config(tmp_path))
    path = root / "model.pt"
    with d.client() as c:
        c.save(blob(1, 1), path, durability="persisted")
    d.restart()  # kill -9, then a new daemon recovers the persisted segment
    with d.client() as c:
        c.wait(path, timeout=30)
        st = c.status(path)
        assert st.stages == ("local", "persisted") and st.persist_state == "persisted"


# ----------------------------------------------------------------- 12. removed directories


def test_a_persist_never_recreates_a_removed_directory(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    blocker = root / "blocker"
    blocker.mkdir(parents=True)
    ckpt_dir = root / "run" / "iter_2"
    ckpt_dir.mkdir(parents=True)
    cfg = config(tmp_path, persist_workers=1, persist_retries=100, persist_backoff=0.1,
                 persist_backoff_max=0.2, orphan_sweep=0)  # fmt: skip
    d = daemon_factory("--persist-root", str(root), "--config", cfg)
    path = ckpt_dir / "sub" / "model.pt"  # "sub" is missing at save time: may be created
    with d.client() as c:
        with read_only_dir(blocker):  # keeps the only persist worker busy
            c.save(blob(1, 0), blocker / "m.pt")
            wait_until(lambda: c.status(blocker / "m.pt").persist_error)
            c.save(blob(1, 1), path)
            assert c.status(path).persist_state == "queued"
            shutil.rmtree(root / "run")  # the user deletes the checkpoint directory
        c.wait(blocker / "m.pt", timeout=60)
        with pytest.raises(CheckpointDeleted, match="was removed since") as err:
            c.wait(path, timeout=60)
        assert isinstance(err.value, OSError)
        st = c.status(path)
        assert st.persist_state == "dropped" and str(ckpt_dir) in st.persist_error
        c.wait(prefix=root, timeout=60)  # a prefix wait skips what the user deleted
        c.wait()
    assert not (root / "run").exists()


def test_missing_directories_are_still_created(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    d = daemon_factory("--persist-root", str(root), "--config", config(tmp_path))
    path = root / "new" / "deeper" / "model.pt"  # nothing exists yet, not even the root
    with d.client() as c:
        c.save(blob(1, 3), path, durability="persisted")
    assert torch.load(path)["step"] == 3


def test_dcp_save_then_rmtree_stays_deleted(daemon_factory, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from ckptcache.adapters.dcp import CacheWriter

    root = tmp_path / "ckpt"
    root.mkdir()
    d = daemon_factory("--persist-root", str(root), "--config", config(tmp_path))
    state = {"w": torch.arange(MiB, dtype=torch.float32), "b": torch.ones(1000)}
    with d.client() as c:
        dirs = [root / f"step_{i}" for i in range(5)]
        for ck in dirs:
            dcp.save(state, storage_writer=CacheWriter(ck, client=c), no_dist=True)
            remove_tree(ck)  # at once, while its persists are queued or running
        wait_until(lambda: idle(c), timeout=120)
    assert sorted(root.iterdir()) == []  # no directory came back


# ----------------------------------------------------------------- 14. memory-only orphans


def test_memory_only_objects_of_a_removed_directory_are_dropped(daemon_factory, tmp_path):
    d = daemon_factory("--config", config(tmp_path, orphan_sweep=0.2))
    tmp = tmp_path / "test-run"
    tmp.mkdir()
    with d.client() as c:
        c.save(blob(1, 1), tmp / "a.pt")
        c.save(blob(1, 2), tmp_path / "kept.pt")
        assert c.status(tmp / "a.pt").persist_state == "memory-only"
        shutil.rmtree(tmp)
        wait_until(lambda: d.status().objects == 1)  # the periodic sweep dropped it
        with pytest.raises(CheckpointNotFound):
            c.load(tmp / "a.pt")
        assert c.load(tmp_path / "kept.pt")["step"] == 2


def test_memory_only_objects_of_a_removed_directory_are_evictable(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "24MiB", "--reserve-timeout", "1",
                       "--config", config(tmp_path, orphan_sweep=0))  # fmt: skip
    tmp = tmp_path / "test-run"
    tmp.mkdir()
    with d.client(fallback="raise") as c:
        c.save(blob(8, 1), tmp / "a.pt")
        c.save(blob(8, 2), tmp / "b.pt")
        shutil.rmtree(tmp)
        c.save(blob(8, 3), tmp_path / "c.pt")  # room comes from the removed directory's objects
        c.save(blob(8, 4), tmp_path / "d.pt")
        assert_same(blob(8, 4), c.load(tmp_path / "d.pt"))
