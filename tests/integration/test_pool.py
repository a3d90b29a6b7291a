"""The spare pool: first saves of new paths land in pre-faulted segments the client already
maps; the pool stays within the budget and never costs a committed generation."""

from __future__ import annotations

import threading

import torch

from ckptcache.wire import messages as m
from tests.helpers import wait_until

MIB = 1 << 20


def blob(mib: int, fill: float = 0.0) -> dict:
    return {"w": torch.full((mib * MIB // 4 - 1024,), float(fill))}


def _spares(c) -> m.PoolReply:
    return c._call("pool", m.PoolRequest(), m.PoolReply)


def _segment_of(c, path: str) -> str:
    reply = c._call("open", m.OpenRequest(c.namespace, path), m.OpenReply)
    c._call("release", m.ReleaseRequest((reply.lease,)))
    return reply.segment


def test_first_save_of_a_new_path_uses_a_spare_the_client_mapped(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as c:
        wait_until(lambda: len(_spares(c).segments) == 1)
        (spare,) = _spares(c).segments
        c.warmup(wait=True)
        assert spare in c._write_maps  # mapped before any save needed it

        path = str(tmp_path / "iter_1" / "model.pt")
        state = blob(4, 3.0)
        c.save(state, path)
        assert _segment_of(c, path) == spare
        assert torch.equal(c.load(path, mmap=False)["w"], state["w"])

        # The next spare is sized like the save that used one (trimmed: 4 MiB + header).
        wait_until(lambda: len(_spares(c).segments) == 1 and not _spares(c).growing)
        reply = _spares(c)
        assert reply.segments[0] != spare and reply.capacities == (5 * MIB,)
        assert d.segment_bytes() <= 64 * MIB


def test_pool_gives_way_to_saves_and_never_evicts_committed(daemon_factory, tmp_path):
    # Memory-only paths cannot be evicted: every byte of the budget must go to them.
    d = daemon_factory(
        "--memory-limit", "32MiB", "--pool-segments", "2", "--pool-bytes", "16MiB",
        "--reserve-timeout", "30",  # a save may wait for the pool's allocation in flight
    )  # fmt: skip
    with d.client(fallback="raise") as c:
        wait_until(lambda: len(_spares(c).segments) == 2)
        paths = [str(tmp_path / f"p{i}.pt") for i in range(3)]
        for i, path in enumerate(paths):
            c.save(blob(9, i), path)  # 10 MiB segments: the 8 MiB spares are too small
            assert d.segment_bytes() <= 32 * MIB
        for i, path in enumerate(paths):
            assert torch.equal(c.load(path)["w"], blob(9, i)["w"])
        status = c.daemon_status()
        assert status.memory_used <= 32 * MIB


def test_pool_disabled_with_zero_bytes(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "64MiB", "--pool-bytes", "0")
    with d.client(fallback="raise") as c:
        c.save(blob(2), str(tmp_path / "a.pt"))
        assert _spares(c).segments == () and not _spares(c).growing


def test_one_lingering_thread_maps_the_spares_after_every_save(daemon_factory, tmp_path):
    """After each save the client maps the daemon's spares with the same thread (woken, not
    started again: a thread start stalled saves on a busy node); every save lands intact."""
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "2", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as c:
        wait_until(lambda: len(_spares(c).segments) == 2 and not _spares(c).growing)
        c.warmup(wait=True)
        assert all(s in c._write_maps for s in _spares(c).segments)
        thread = c._spares._thread
        assert thread is not None and thread.is_alive()
        for i in range(3):
            path = str(tmp_path / f"iter_{i}" / "model.pt")
            state = blob(4, float(i))
            c.save(state, path)
            assert torch.equal(c.load(path, mmap=False)["w"], state["w"])
            # Each save takes one spare and the pool grows another: wait for both to stand.
            wait_until(lambda: len(_spares(c).segments) == 2 and not _spares(c).growing)
            c._spares.refresh().wait()
            assert all(s in c._write_maps for s in _spares(c).segments)
            assert c._spares._thread is thread
    thread.join(5)
    assert not thread.is_alive()  # close() ended it


def test_a_spare_trimmed_before_the_client_maps_it_does_not_stall_the_save(
    daemon_factory, tmp_path
):
    """The daemon may hand a listed spare to a save and trim it before this client's spare
    thread maps it at the listed size (mmap refuses a length past the end of the file). That
    spare is skipped, and a save that gets it maps it itself instead of waiting forever for
    a mapping that never comes."""
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as c:
        wait_until(lambda: len(_spares(c).segments) == 1 and not _spares(c).growing)
        (spare,), (capacity,) = _spares(c).segments, _spares(c).capacities
        c._spares._map(spare, capacity + 8 * MIB)  # as if trimmed after the listing
        assert spare not in c._spares.mapping_now and spare not in c._write_maps

        path = str(tmp_path / "iter_1" / "model.pt")
        state = blob(4, 5.0)
        done: list[object] = []
        saver = threading.Thread(target=lambda: done.append(c.save(state, path)), daemon=True)
        saver.start()
        saver.join(60)
        assert done, "the save waited for a spare mapping that never came"
        assert _segment_of(c, path) == spare
        assert torch.equal(c.load(path, mmap=False)["w"], state["w"])
