"""The writer thread of streamed local writes (``ckptcache.storage.handoff``): pieces land in
order and whole, an error on either side fails the write with that error, and nothing is
written after the call returns (the caller's fsync comes after every byte)."""

from __future__ import annotations

import os
import threading

import pytest

from ckptcache.storage.fs import FileBackend
from ckptcache.storage.handoff import Handoff, threaded

MIB = 1 << 20


def _pieces() -> list[bytes]:
    # Uneven sizes, some larger than what may wait queued at once.
    return [os.urandom(n) for n in (1, 5 * MIB + 3, 4096, 40 * MIB + 1, 7, 3 * MIB)]


def test_pieces_reach_the_file_in_order_and_whole(tmp_path):
    pieces = _pieces()
    path = str(tmp_path / "a.pt")

    def produce(sink) -> None:
        for piece in pieces:
            sink(memoryview(piece))

    FileBackend().write_stream(path, produce)
    with open(path, "rb") as f:
        assert f.read() == b"".join(pieces)


def test_the_writers_error_stops_the_producer_and_fails_the_write(tmp_path):
    handed: list[int] = []

    def produce(sink) -> None:
        for n in range(1000):
            handed.append(n)
            sink(b"x" * MIB)

    written: list[int] = []

    def write(piece) -> None:
        written.append(len(piece))
        if len(written) == 3:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        threaded(produce, write)
    assert len(written) == 3  # nothing written after the failure
    assert len(handed) < 1000  # the producer stopped (it waits on a bounded queue)


def test_a_producer_error_is_raised_and_the_writer_has_stopped_when_it_is(tmp_path):
    started = threading.Event()
    release = threading.Event()
    written: list[int] = []

    def write(piece) -> None:
        started.set()
        release.wait(5)
        written.append(len(piece))

    def produce(sink) -> None:
        sink(b"a" * MIB)
        started.wait(5)
        for _ in range(3):
            sink(b"b")
        release.set()
        raise ValueError("tensor changed")

    with pytest.raises(ValueError, match="tensor changed"):
        threaded(produce, write)
    assert written and written[0] == MIB  # the piece in hand was finished; queued ones dropped
    # The writer thread is gone when the error reaches the caller: nothing writes to the
    # descriptor once it is closed.
    assert not any(t.name == "ckptcache-write" for t in threading.enumerate())


def test_a_failed_stream_names_nothing(tmp_path):
    path = str(tmp_path / "b.pt")

    def produce(sink) -> None:
        sink(b"x" * (3 * MIB))
        raise ValueError("abandoned")

    with pytest.raises(ValueError, match="abandoned"):
        FileBackend().write_stream(path, produce)
    assert os.listdir(tmp_path) == []


def test_a_writers_error_is_raised_at_finish_when_nothing_more_is_put():
    def write(piece) -> None:
        raise OSError(5, "Input/output error")

    handoff = Handoff(write)
    handoff.put(b"x")
    with pytest.raises(OSError, match="Input/output"):
        handoff.finish()


@pytest.mark.skipif(not hasattr(threading, "get_native_id"), reason="needs thread ids")
def test_the_writer_runs_at_the_callers_cpu_priority():
    """The persist worker lowers its own thread's priority (nice +10) so that it yields to
    training; its writer thread must yield as well."""
    seen: list[int] = []

    def write(piece) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def worker() -> None:
        own = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, own, os.getpriority(os.PRIO_PROCESS, own) + 3)
        threaded(lambda sink: sink(b"x"), write)
        seen.append(os.getpriority(os.PRIO_PROCESS, own))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)
