"""CachedDataLoader in one process: exact sequences, resume, bounds, hygiene, hooks."""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptcache.data import BatchLoadError, BatchTimeout, CachedDataLoader
from ckptcache.data._lease import Lease
from ckptcache.data._positions import Pos, distance
from ckptcache.data._store import RECLAIM_AFTER_S, RUN_MARKER, BatchDir
from ckptcache.errors import CkptCacheError, ConfigError
from tests.data._dataset import SeqLoader, batch_digest, make_batch
from tests.helpers import wait_until


def _digests(batches: list[Any]) -> list[str]:
    return [batch_digest(b) for b in batches]


def _reference(epochs: int, n: int) -> list[str]:
    return [batch_digest(make_batch(e, i)) for e in range(epochs) for i in range(n)]


def _batch_files(cache_dir: str, run_id: str = "r") -> list[str]:
    path = os.path.join(cache_dir, run_id, "train")
    return sorted(f for f in os.listdir(path) if f.endswith(".batch"))


def test_epochs_are_exact(cache_dir: str) -> None:
    with CachedDataLoader(lambda: SeqLoader(5), cache_dir=cache_dir, run_id="r", prefetch=3) as dl:
        got = [b for _ in range(3) for b in dl]
        assert len(dl) == 5
        assert dl.state_dict() == {
            "run_id": "r", "name": "train", "epoch": 3, "step": 0, "length": 5,
        }  # fmt: skip
    assert _digests(got) == _reference(3, 5)
    assert not os.path.exists(os.path.join(cache_dir, "r"))  # close() removed the cache


def test_resume_serves_cached_batches_then_catches_up(cache_dir: str) -> None:
    first = CachedDataLoader(lambda: SeqLoader(12), cache_dir=cache_dir, run_id="r", prefetch=4)
    it = iter(first)
    consumed = [next(it) for _ in range(5)]
    state = first.state_dict()
    # Let the prefetcher fill its window, then "crash": the files stay in shared memory.
    want = [f"e000000-s{i:012d}.batch" for i in range(3, 9)]
    # lookback 2 (3, 4) + prefetch 4 (5..8)
    wait_until(lambda: _batch_files(cache_dir) == want, 10, f"the batch files {want}")
    first.close(keep_cache=True)

    loaders: list[SeqLoader] = []

    def make() -> SeqLoader:
        loaders.append(SeqLoader(12))
        return loaders[-1]

    with CachedDataLoader(make, cache_dir=cache_dir, run_id="r", prefetch=4) as second:
        second.load_state_dict(state)
        rest = list(second)
    assert _digests(consumed + rest) == _reference(1, 12)
    # The new real loader never wrote what was cached: it skipped 5..8 and produced 9..11.
    assert [p for p in loaders[0].produced if p[1] >= 5] == [(0, i) for i in range(5, 12)]


def test_skip_hook_avoids_reading_skipped_batches(cache_dir: str) -> None:
    loaders: list[SeqLoader] = []

    def make() -> SeqLoader:
        loaders.append(SeqLoader(10, with_skip=True))
        return loaders[-1]

    with CachedDataLoader(make, cache_dir=cache_dir, run_id="r", start_step=6) as dl:
        got = list(dl)
    assert _digests(got) == _reference(1, 10)[6:]
    assert loaders[0].produced[0] == (0, 6)


def test_set_epoch_reaches_the_sampler_and_positions(cache_dir: str) -> None:
    with CachedDataLoader(
        lambda: SeqLoader(4), cache_dir=cache_dir, run_id="r", start_epoch=2, start_step=1
    ) as dl:
        got = list(dl)
        dl.set_epoch(3)  # no-op: already there
        more = list(itertools.islice(dl, 2))
        dl.set_epoch(7)
        last = list(dl)
    assert _digests(got) == [batch_digest(make_batch(2, i)) for i in (1, 2, 3)]
    assert _digests(more) == [batch_digest(make_batch(3, i)) for i in (0, 1)]
    assert _digests(last) == [batch_digest(make_batch(7, i)) for i in range(4)]


def test_torch_dataloader_with_workers(cache_dir: str) -> None:
    data = torch.arange(40, dtype=torch.float32).reshape(20, 2)

    def make() -> torch.utils.data.DataLoader[Any]:
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(data), batch_size=4, num_workers=1
        )

    with CachedDataLoader(make, cache_dir=cache_dir, run_id="r", prefetch=2) as dl:
        got = list(dl)
    assert len(got) == 5
    assert torch.equal(torch.cat([b[0] for b in got]), data)


def _size_or_zero(path: str) -> int:
    """Size of a batch file, 0 if the prefetcher evicted it after we listed the directory."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def test_cache_stays_within_prefetch_lookback_and_max_bytes(cache_dir: str) -> None:
    one = 4096 + 64 * 1024  # a batch file: header page + 64 KiB of tensor + metadata
    with CachedDataLoader(
        lambda: SeqLoader(30, numel=16 * 1024), cache_dir=cache_dir, run_id="r",
        prefetch=8, lookback=2, max_bytes=5 * one + 5 * 1024,
    ) as dl:  # fmt: skip
        largest = 0
        for _ in dl:
            files = _batch_files(cache_dir)
            sizes = [_size_or_zero(os.path.join(cache_dir, "r", "train", f)) for f in files]
            largest = max(largest, sum(sizes))
            assert len(files) <= 2 + 1 + 8
        assert largest <= 5 * one + 5 * 1024


def test_stale_runs_are_ignored_and_reclaimed(cache_dir: str) -> None:
    # A dead run's batches, with the same step names as ours but other content.
    old = CachedDataLoader(
        lambda: SeqLoader(6, numel=8), cache_dir=cache_dir, run_id="old", prefetch=6
    )
    next(iter(old))
    old_dir = os.path.join(cache_dir, "old", "train")
    wait_until(lambda: os.path.exists(os.path.join(old_dir, "e000000-s000000000001.batch")))
    old.close(keep_cache=True)
    lease = os.path.join(old_dir, "owner")
    dead = Lease(pid=2**22 + 17, start_time=1, pid_namespace=0, host="gone", heartbeat=0)
    dead.write(lease)
    past = time.time() - RECLAIM_AFTER_S - 5
    os.utime(lease, (past, past))
    # A foreign file planted under our run's name is refused, not served.
    os.makedirs(os.path.join(cache_dir, "new", "train"))
    os.link(
        os.path.join(old_dir, "e000000-s000000000001.batch"),
        os.path.join(cache_dir, "new", "train", "e000000-s000000000001.batch"),
    )
    with CachedDataLoader(lambda: SeqLoader(6), cache_dir=cache_dir, run_id="new") as dl:
        got = list(dl)
        assert not os.path.exists(os.path.join(cache_dir, "old"))  # reclaimed at start
    assert _digests(got) == _reference(1, 6)


def _dead_run(cache_dir: str, run_id: str) -> str:
    """A run directory as ckptcache leaves it after a crash, its loader long dead."""
    bdir = BatchDir(cache_dir, run_id, "train")
    dead = Lease(pid=2**22 + 17, start_time=1, pid_namespace=0, host="gone", heartbeat=0)
    dead.write(bdir.lease_path)
    past = time.time() - RECLAIM_AFTER_S - 5
    os.utime(bdir.lease_path, (past, past))
    return bdir.run_dir


def test_directories_ckptcache_did_not_create_are_never_reclaimed(
    cache_dir: str, tmp_path: Path
) -> None:
    os.makedirs(cache_dir, mode=0o700)
    past = time.time() - RECLAIM_AFTER_S - 5
    # The user's own files next to the cache (cache_dir is their scratch directory).
    users = {
        "datasets/imagenet/train/shard0.tar": "x" * 100,
        "results/metrics.json": "{}",
        f"scratch/sub/.tmp-{2**22 + 17}-0": "a dead writer's name, but not ours",
    }
    for rel, text in users.items():
        os.makedirs(os.path.dirname(os.path.join(cache_dir, rel)), exist_ok=True)
        Path(cache_dir, rel).write_text(text)
    os.makedirs(os.path.join(cache_dir, "empty"))
    # Links are never followed: not to a directory that looks like a dead run, nor to a marker.
    outside = _dead_run(str(tmp_path / "elsewhere"), "looks-dead")
    os.symlink(outside, os.path.join(cache_dir, "link"))
    os.makedirs(os.path.join(cache_dir, "fake", "train"))
    os.symlink(os.path.join(outside, RUN_MARKER), os.path.join(cache_dir, "fake", RUN_MARKER))
    for root, dirs, _ in os.walk(cache_dir):
        for d in dirs:
            os.utime(os.path.join(root, d), (past, past), follow_symlinks=False)
    ours = _dead_run(cache_dir, "old")  # a dead run ckptcache created: this one goes

    with CachedDataLoader(lambda: SeqLoader(2), cache_dir=cache_dir, run_id="r") as dl:
        assert _digests(list(dl)) == _reference(1, 2)
        assert not os.path.exists(ours)
        for rel, text in users.items():
            assert Path(cache_dir, rel).read_text() == text
        for kept in ("empty", "link", "fake/train"):
            assert os.path.lexists(os.path.join(cache_dir, kept))
        assert os.path.exists(os.path.join(outside, "train", "owner"))
    assert sorted(os.listdir(cache_dir)) == ["datasets", "empty", "fake", "link", "results",
                                             "scratch"]  # fmt: skip


class _ListedThenRemoved:
    """What ``os.scandir`` gives when another rank deletes the directory right after."""

    def __init__(self, entries: list[os.DirEntry[str]]):
        self.entries = entries

    def __iter__(self) -> Iterator[os.DirEntry[str]]:
        return iter(self.entries)

    def __enter__(self) -> Iterator[os.DirEntry[str]]:
        return iter(self.entries)

    def __exit__(self, *exc: object) -> None:
        pass


def test_runs_reclaimed_by_another_rank_meanwhile_do_not_fail_the_start(
    cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone_before, gone_after = _dead_run(cache_dir, "old0"), _dead_run(cache_dir, "old1")
    real_scandir = os.scandir

    def racing(path: Any = ".") -> Any:
        # Another loading rank reclaims the same dead runs at the same moment.
        if path == gone_before:
            shutil.rmtree(path)
        if path == gone_after:
            with real_scandir(path) as it:
                entries = list(it)
            shutil.rmtree(path)
            return _ListedThenRemoved(entries)
        return real_scandir(path)

    with monkeypatch.context() as m:
        m.setattr(os, "scandir", racing)
        dl = CachedDataLoader(lambda: SeqLoader(3), cache_dir=cache_dir, run_id="r")
    with dl:
        assert _digests(list(dl)) == _reference(1, 3)
    assert os.listdir(cache_dir) == []


def test_a_live_run_is_not_reclaimed(cache_dir: str) -> None:
    with CachedDataLoader(lambda: SeqLoader(3), cache_dir=cache_dir, run_id="a") as a:
        with CachedDataLoader(lambda: SeqLoader(3), cache_dir=cache_dir, run_id="b") as b:
            assert len(list(b)) == 3
        assert _digests(list(a)) == _reference(1, 3)


def test_loader_errors_reach_the_consumer(cache_dir: str) -> None:
    def broken() -> SeqLoader:
        raise OSError("remote store unreachable")

    with CachedDataLoader(broken, cache_dir=cache_dir, run_id="r") as dl:
        with pytest.raises(BatchLoadError, match="remote store unreachable") as info:
            next(iter(dl))
        assert isinstance(info.value.__cause__, OSError)


def test_the_live_loading_ranks_failure_reaches_readers(cache_dir: str) -> None:
    with CachedDataLoader(
        lambda: SeqLoader(6, fail_at=2), cache_dir=cache_dir, run_id="r", prefetch=4
    ) as loading:
        # Raised as the reader starts, where the loading rank failed before (a loaded
        # machine), else as it reads.
        with (
            pytest.raises(BatchLoadError, match="transient storage error at batch 2"),
            CachedDataLoader(
                None, cache_dir=cache_dir, run_id="r", is_loading_rank=False, timeout=30
            ) as reader,
        ):
            list(reader)
        with pytest.raises(BatchLoadError):
            list(loading)


def test_reader_without_loader_times_out(cache_dir: str) -> None:
    with (
        CachedDataLoader(
            None, cache_dir=cache_dir, run_id="r", is_loading_rank=False, timeout=0.3
        ) as dl,
        pytest.raises(BatchTimeout, match="no loading rank has started"),
    ):
        next(iter(dl))


def test_second_loading_rank_is_refused(cache_dir: str) -> None:
    with CachedDataLoader(lambda: SeqLoader(3), cache_dir=cache_dir, run_id="r") as dl:
        # Another process would be refused; this one owns the lease, so only a fake owner can
        # show it: pretend pid 1 (alive) holds it.
        mine = Lease.mine()
        Lease(1, _start_time_of_init(), mine.pid_namespace, mine.host, 0).write(
            os.path.join(cache_dir, "r", "train", "owner")
        )
        with pytest.raises(ConfigError, match="already has a live loading rank"):
            CachedDataLoader(lambda: SeqLoader(3), cache_dir=cache_dir, run_id="r")
        dl.close()


def _start_time_of_init() -> int:
    from ckptcache.data._lease import _start_time

    return _start_time(1) or 0


def test_an_abandoned_loader_of_this_process_is_taken_over(cache_dir: str) -> None:
    # An exception left the first loader unclosed (Lightning does not close it on a fault);
    # the retry in the same process takes over its directory and its cached batches.
    first = CachedDataLoader(lambda: SeqLoader(6), cache_dir=cache_dir, run_id="r")
    it = iter(first)
    got = [next(it) for _ in range(2)]
    second = CachedDataLoader(lambda: SeqLoader(6), cache_dir=cache_dir, run_id="r")
    with pytest.raises(CkptCacheError, match="closed"):
        next(it)  # stopped: never two prefetchers on one directory
    with second:
        second.load_state_dict(first.state_dict())
        got += list(second)
    assert _digests(got) == _reference(1, 6)


def test_unsafe_names_are_refused(cache_dir: str) -> None:
    for bad in ("../x", ".hidden", "a/b", ""):
        with pytest.raises(ConfigError):
            CachedDataLoader(lambda: [], cache_dir=cache_dir, run_id=bad)


def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)  # give it to "nobody"
    else:  # only root may give a directory away; the root directory is someone else's
        theirs = Path("/")
    with pytest.raises(ConfigError, match=f"is owned by uid {os.stat(theirs).st_uid}"):
        CachedDataLoader(lambda: [], cache_dir=str(theirs), run_id="r")


@pytest.mark.parametrize("loading", [True, False])
def test_directories_others_could_plant_batches_in_are_refused(
    cache_dir: str, tmp_path: Path, loading: bool
) -> None:
    def make() -> CachedDataLoader:
        return CachedDataLoader(
            (lambda: SeqLoader(2)) if loading else None, cache_dir=cache_dir, run_id="r",
            is_loading_rank=loading,
        )  # fmt: skip

    os.makedirs(cache_dir, mode=0o700)
    os.chmod(cache_dir, 0o777)  # ours, but anybody may create the run directory in it
    with pytest.raises(ConfigError, match=r"cache directory .* writable by other users \(mode"):
        make()
    os.chmod(cache_dir, 0o700)
    run = os.path.join(cache_dir, "r")
    os.makedirs(os.path.join(run, "train"))
    os.chmod(os.path.join(run, "train"), 0o777)  # planted before the job started
    with pytest.raises(ConfigError, match=r"run directory .*/r/train is writable by other"):
        make()
    os.chmod(os.path.join(run, "train"), 0o700)
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(run, 65534, 65534)
        with pytest.raises(ConfigError, match=r"run directory .*/r is owned by uid 65534"):
            make()
        os.chown(run, 0, 0)
    shutil.rmtree(run)
    os.symlink(str(tmp_path), run)
    with pytest.raises(ConfigError, match=r"run directory .*/r is a symbolic link"):
        make()
    os.unlink(run)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    shutil.rmtree(cache_dir)
    os.symlink(real, cache_dir)
    with pytest.raises(ConfigError, match=r"cache directory .* is a symbolic link"):
        make()
    os.unlink(cache_dir)
    with make() as dl:  # a private directory is fine
        if loading:
            assert _digests(list(dl)) == _reference(1, 2)


def test_cache_false_is_a_plain_pass_through(cache_dir: str) -> None:
    dl = CachedDataLoader(lambda: SeqLoader(3), cache_dir=cache_dir, run_id="r", cache=False)
    assert _digests(list(dl)) == _reference(1, 3)
    assert len(dl) == 3
    assert not os.path.exists(cache_dir)


def test_distance_across_epochs() -> None:
    ends = {0: 5}
    assert distance(Pos(0, 3), Pos(1, 2), ends) == 4
    assert distance(Pos(1, 2), Pos(0, 3), ends) == -4
    assert distance(Pos(1, 0), Pos(2, 0), ends) > 10**12  # epoch 1's length is unknown
    assert Pos(0, 5).normalized(ends) == Pos(1, 0)
