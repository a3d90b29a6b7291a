"""The spare pool: first saves of new paths land in pre-faulted segments the client already
maps; the pool is sized from the saves, stays within the budget, never costs a committed
generation, and a clean stop leaves only committed generations in the shm directory."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import ckptcache
from ckptcache.wire import messages as m
from tests.helpers import wait_until

MIB = 1 << 20


def blob(mib: int, fill: float = 0.0) -> dict:
    return {"w": torch.full((mib * MIB // 4 - 1024,), float(fill))}


def _spares(c) -> m.PoolReply:
    return c._connection.call("pool", m.PoolRequest(), m.PoolReply)


def _settled(c, count: int) -> m.PoolReply | None:
    reply = _spares(c)
    return reply if len(reply.segments) == count and not reply.growing else None


def _segment_of(c, path: str) -> str:
    reply = c._connection.call("open", m.OpenRequest(c.namespace, path), m.OpenReply)
    c._connection.call("release", m.ReleaseRequest((reply.lease,)))
    return reply.segment


def _teach(c, tmp_path, *mibs: int) -> m.PoolReply:
    """Saves of these sizes under paths of their own (a trainer's first checkpoint): the
    pool then holds a spare of each size."""
    for i, mib in enumerate(mibs):
        c.save(blob(mib, 9.0), str(tmp_path / "first" / f"{i}.pt"))
    return wait_until(lambda: _settled(c, len(mibs)), what="the pool sized by the saves")


def test_first_save_of_a_new_path_uses_a_spare_the_client_mapped(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as c:
        (spare,) = _teach(c, tmp_path, 4).segments  # the first checkpoint: 4 MiB
        c.warmup(wait=True)
        assert spare in c._parts.maps  # mapped before any save needed it

        path = str(tmp_path / "iter_1" / "model.pt")  # the next checkpoint: a new path
        state = blob(4, 3.0)
        c.save(state, path)
        assert _segment_of(c, path) == spare
        assert torch.equal(c.load(path, mmap=False)["w"], state["w"])

        # The next spare is sized like the save that used one (4 MiB + header).
        reply = wait_until(lambda: _settled(c, 1))
        assert reply.segments[0] != spare and reply.capacities == (5 * MIB,)
        assert d.segment_bytes() <= 64 * MIB


def test_a_fresh_client_gets_the_spare_it_mapped_not_a_freed_segment(daemon_factory, tmp_path):
    """A freed segment (a deleted checkpoint's) and a spare, both free and both the right
    size: a new client that mapped the spare at its first contact gets the spare, not the
    freed segment it never mapped (whose page tables its save would have to build)."""
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    first = str(tmp_path / "first" / "0.pt")
    with d.client(fallback="raise") as old:  # an earlier trainer: its checkpoint is deleted
        (spare,) = _teach(old, tmp_path, 4).segments
        freed = _segment_of(old, first)
        old.delete(first)
    with d.client(fallback="raise") as c:
        wait_until(lambda: c.daemon_status().free_segments == 2, what="the freed segment")
        assert _spares(c).segments == (spare,)  # the freed one is free, not a spare
        c.warmup(wait=True)
        assert spare in c._parts.maps and freed not in c._parts.maps

        path = str(tmp_path / "iter_1" / "model.pt")
        state = blob(4, 6.0)
        c.save(state, path)
        assert _segment_of(c, path) == spare
        assert torch.equal(c.load(path, mmap=False)["w"], state["w"])


def test_pool_gives_way_to_saves_and_never_evicts_committed(daemon_factory, tmp_path):
    # Memory-only paths cannot be evicted: every byte of the budget must go to them.
    d = daemon_factory(
        "--memory-limit", "32MiB", "--pool-segments", "2", "--pool-bytes", "16MiB",
        "--reserve-timeout", "30",  # a save may wait for the pool's allocation in flight
    )  # fmt: skip
    with d.client(fallback="raise") as c:
        _teach(c, tmp_path, 7, 7)  # two 8 MiB spares, then the objects that sized them go
        for i in range(2):
            c.delete(str(tmp_path / "first" / f"{i}.pt"))
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


def test_the_spare_thread_maps_the_spares_after_every_save_and_then_ends(daemon_factory, tmp_path):
    """After each save the client maps the daemon's spares in its background thread; every
    save lands intact; the thread ends by itself once that is done (none of the client's
    threads outlives its work), and ``close()`` ends one still running."""
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "2", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as c:
        _teach(c, tmp_path, 4, 4)
        c.warmup(wait=True)
        assert all(s in c._parts.maps for s in _spares(c).segments)
        for i in range(3):
            path = str(tmp_path / f"iter_{i}" / "model.pt")
            state = blob(4, float(i))
            c.save(state, path)
            assert torch.equal(c.load(path, mmap=False)["w"], state["w"])
            # Each save takes one spare and the pool grows another: wait for both to stand.
            wait_until(lambda: _settled(c, 2))
            c._spares.refresh().wait()
            assert all(s in c._parts.maps for s in _spares(c).segments)
        wait_until(lambda: not _spare_threads(), what="the spare thread to end")
        c.save(blob(4, 7.0), str(tmp_path / "last.pt"))  # starts it again
        running = _spare_threads()
    for thread in running:
        thread.join(5)
        assert not thread.is_alive()  # close() ended it


def _spare_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptcache-spares" and t.is_alive()]


def test_a_spare_trimmed_before_the_client_maps_it_does_not_stall_the_save(
    daemon_factory, tmp_path, monkeypatch
):
    """The daemon may hand a listed spare to a save and trim it before this client's spare
    thread maps it at the listed size (mmap refuses a length past the end of the file). That
    spare is skipped, and a save that gets it maps it itself instead of waiting forever for
    a mapping that never comes."""
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as teacher:  # its spare thread, not c's, may map the spare
        reply = _teach(teacher, tmp_path, 4)
    # Not started as it is made (its own thread would map the spare at its size first).
    monkeypatch.setattr(ckptcache.Client, "_start_early", lambda self: None)
    with d.client(fallback="raise") as c:
        (spare,), (capacity,) = reply.segments, reply.capacities
        c._spares._map(spare, capacity + 8 * MIB)  # as if trimmed after the listing
        assert spare not in c._spares.mapping_now and spare not in c._parts.maps

        path = str(tmp_path / "iter_1" / "model.pt")
        state = blob(4, 5.0)
        done: list[object] = []
        saver = threading.Thread(target=lambda: done.append(c.save(state, path)), daemon=True)
        saver.start()
        saver.join(60)
        assert done, "the save waited for a spare mapping that never came"
        assert _segment_of(c, path) == spare
        assert torch.equal(c.load(path, mmap=False)["w"], state["w"])


def _stalled_steps(monkeypatch) -> tuple[threading.Event, list[bool]]:
    """The spare thread's steps, made to wait for their stop (at most 30 s) as if the steps
    were slow: returns the event set once they started, and whether each population was
    stopped."""
    from ckptcache.format import pagetables

    started, stopped = threading.Event(), []

    def slow_steps(mapping, step=None, stop=None):
        started.set()
        deadline = time.monotonic() + 30
        while not (stop is not None and stop.is_set()) and time.monotonic() < deadline:
            time.sleep(0.005)
        stopped.append(stop is not None and stop.is_set())
        return False

    monkeypatch.setattr(pagetables, "populate_in_steps", slow_steps)
    return started, stopped


def test_a_save_stops_the_mapping_of_its_spare_and_its_copy_threads_make_the_rest(
    daemon_factory, tmp_path, monkeypatch
):
    """The spare thread makes a spare's page tables a step at a time, so the trainer's own
    mmap and munmap never wait for the whole spare. A save that gets the spare meanwhile
    stops the steps (it waits for the one under way, not for all of them), and the rest of
    the page tables are made on its copy threads before its copy."""
    import ckptcache.codec.shm as shm
    from ckptcache.format import pagetables

    if not pagetables.POPULATE_IN_PARALLEL:
        pytest.skip("before Linux 5.14 the spare is mapped with MAP_POPULATE: nothing to stop")
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as teacher:  # its spare thread, not c's, may map the spare
        (spare,), (capacity,) = _teach(teacher, tmp_path, 4).segments, _spares(teacher).capacities
    started, stopped = _stalled_steps(monkeypatch)
    populated: list[int] = []
    real_parallel = shm.populate_in_parallel
    monkeypatch.setattr(
        shm, "populate_in_parallel", lambda mp: (populated.append(len(mp)), real_parallel(mp))
    )
    with d.client(fallback="raise") as c:
        c.daemon_status()  # connected, no spare mapped by its own thread
        mapper = threading.Thread(target=c._spares._map, args=(spare, capacity), daemon=True)
        mapper.start()
        assert started.wait(30), "the spare's steps never started"
        path = str(tmp_path / "iter_1" / "model.pt")
        state = blob(4, 5.0)
        c.save(state, path)
        mapper.join(30)
        assert not mapper.is_alive()
        assert stopped == [True]  # the save stopped the steps, rather than waiting them out
        assert _segment_of(c, path) == spare and spare in c._parts.maps
        assert populated == [capacity]  # the rest made by the save, before its copy
        assert spare not in c._parts.maps._unpopulated
        assert torch.equal(c.load(path, mmap=False)["w"], state["w"])


def test_closing_the_client_stops_a_spare_being_mapped(daemon_factory, tmp_path, monkeypatch):
    """close() stops the steps of a spare being mapped (nobody will use it) and unmaps what
    they made."""
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as teacher:
        (spare,), (capacity,) = _teach(teacher, tmp_path, 4).segments, _spares(teacher).capacities
    started, stopped = _stalled_steps(monkeypatch)
    c = d.client(fallback="raise")
    c.daemon_status()
    mapper = threading.Thread(target=c._spares._map, args=(spare, capacity), daemon=True)
    mapper.start()
    assert started.wait(30), "the spare's steps never started"
    c.close()
    mapper.join(30)
    assert not mapper.is_alive()
    assert stopped == [True]
    assert spare not in c._parts.maps and spare not in c._spares.ready


def test_a_clean_stop_leaves_only_committed_generations(daemon_factory, tmp_path):
    """SIGTERM: the spares and the free segments (no data in them) are unlinked; the committed
    generation stays in the shm directory and a restarted daemon serves it."""
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "2", "--pool-bytes", "16MiB")
    kept, gone = str(tmp_path / "kept.pt"), str(tmp_path / "gone.pt")
    with d.client(fallback="raise") as c:
        c.save(blob(2, 1.0), kept)
        c.save(blob(4, 2.0), gone)
        wait_until(lambda: _settled(c, 2))
        c.delete(gone)  # its segment goes to the free list
        segment = os.path.basename(_segment_of(c, kept))
        assert c.daemon_status().free_segments >= 3  # the spares and the deleted object's
    d.kill(signal.SIGTERM)
    assert d.proc is not None and d.proc.returncode == 0, d.log()[-3000:]
    assert [n for n in os.listdir(d.segments_dir) if n.startswith("seg-")] == [segment]
    d.start()
    with d.client(fallback="raise") as c:
        assert torch.equal(c.load(kept, mmap=False)["w"], blob(2, 1.0)["w"])


def test_a_spare_mapped_while_the_client_closes_is_unmapped_not_kept(
    daemon_factory, tmp_path, monkeypatch
):
    """close() empties the cache of mappings; a spare the thread was mapping meanwhile must
    not land in it afterwards (nobody would unmap it, or end its CUDA registration)."""
    import ckptcache.codec.shm as shm

    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as teacher:
        reply = _teach(teacher, tmp_path, 4)
    (spare,), (capacity,) = reply.segments, reply.capacities
    # Not started as it is made (mapping the spare on its own thread): mapped by hand below.
    monkeypatch.setattr(ckptcache.Client, "_start_early", lambda self: None)
    c = d.client(fallback="raise")
    c.daemon_status()  # connected (where segments are), no spare mapped by its own thread
    release, made = threading.Event(), []
    real = shm.map_shared

    def slow_map(path: str, size: int, **kw: object) -> object:
        release.wait(30)
        made.append(real(path, size, **kw))
        return made[-1]

    monkeypatch.setattr(shm, "map_shared", slow_map)
    mapper = threading.Thread(target=c._spares._map, args=(spare, capacity), daemon=True)
    mapper.start()
    wait_until(lambda: spare in c._spares.mapping_now, what="the spare being mapped")
    c.close()
    release.set()
    mapper.join(30)
    assert not mapper.is_alive()
    assert len(made) == 1 and made[0].closed
    assert spare not in c._parts.maps and spare not in c._spares.ready


def test_spares_are_registered_for_cuda_after_warmup_not_at_a_first_contact(
    daemon_factory, tmp_path, monkeypatch
):
    """A first contact's spare is not registered: the save that made the contact may be
    copying into it, and would wait for the registration. warmup() and the rounds after a
    save do register (where the process uses CUDA: gpu_pinning decides that), the spares
    mapped as the client was made included."""
    import ckptcache.codec.gpu.pinning as gpu_pinning

    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "1", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as teacher:
        (spare,) = _teach(teacher, tmp_path, 4).segments
    asked: list[object] = []
    monkeypatch.setattr(gpu_pinning, "reserve_if_cuda", lambda mapping: asked.append(mapping))
    with d.client(fallback="raise") as c:
        assert not c.exists(str(tmp_path / "resume.pt"))  # the first contact
        wait_until(lambda: spare in c._parts.maps, what="the spare mapped")
        assert asked == []
    with d.client(fallback="raise") as c:
        c.warmup(wait=True)
        assert spare in c._parts.maps
        assert asked == [c._parts.maps._maps[spare]]


def test_the_spare_thread_waits_for_the_files_of_a_checkpoint_to_be_saved(
    daemon_factory, tmp_path, monkeypatch
):
    """The files of one checkpoint are saved one after another: the spare thread's ``pool``
    request (it holds the connection) comes only once saves have paused, never between
    them, and the spares the last save left are mapped then."""
    from ckptcache.client import _segments, _spares

    monkeypatch.setattr(_spares, "_SETTLE_SECONDS", 2.0)  # far longer than a save here
    asked: list[str] = []
    real_pool = _segments.WriteMaps.pool

    def pool(self):
        asked.append(threading.current_thread().name)
        return real_pool(self)

    monkeypatch.setattr(_segments.WriteMaps, "pool", pool)
    d = daemon_factory("--memory-limit", "64MiB", "--pool-segments", "2", "--pool-bytes", "16MiB")
    with d.client(fallback="raise") as c:
        _teach(c, tmp_path, 4, 4)
        c.warmup(wait=True)
        asked.clear()
        files = {f"{name}.pt": blob(4, float(i)) for i, name in enumerate(["model", "optim"])}
        for name, state in files.items():  # a checkpoint of two files, back to back
            c.save(state, str(tmp_path / "iter_1" / name))
        assert asked == []  # nothing sent between (or right after) the two saves
        c._spares.refresh().wait()  # once saves paused: the spares the saves left, mapped
        assert asked and set(asked) == {"ckptcache-spares"}
        reply = wait_until(lambda: _settled(c, 2))
        c._spares.refresh().wait()
        assert all(s in c._parts.maps for s in reply.segments)
        for name, state in files.items():
            assert torch.equal(c.load(str(tmp_path / "iter_1" / name), mmap=False)["w"],
                               state["w"])  # fmt: skip
