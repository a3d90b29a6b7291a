"""The group read keeps its landed prefix moving: ranges in order, a bounded lead past a slow
first range, tapered ranges at the end, and the first error raised with nothing left running.

A real range reader over bytes in memory, with one range held back on an event: the slow
request of a TCP flow that lost its share of the link.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from ckptcache.format.prefix_read import PrefixReads, plan_ranges

MiB = 1 << 20


class HeldBack:
    """Reads from ``data``; the range at ``held`` waits until :meth:`release`."""

    def __init__(self, data: bytes, held: int):
        self.data, self.held = data, held
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.requested: list[int] = []  # offsets, in the order the requests began

    def read_into(self, off: int, view: memoryview, progress: Callable[[int], None]) -> None:
        with self.lock:
            self.requested.append(off)
        if off == self.held:  # its first half lands, then the flow stalls
            half = len(view) // 2
            view[:half] = self.data[off : off + half]
            progress(half)
            assert self.gate.wait(10), "the held range was never released"
        view[:] = self.data[off : off + len(view)]
        progress(len(view))


def test_ranges_taper_to_one_block_at_the_end():
    ranges = plan_ranges(64 * MiB + 9000, 4 * MiB, 4, MiB)
    sizes = [n for _, n in ranges]
    assert sizes[:13] == [4 * MiB] * 13
    assert sizes[13:] == [2 * MiB] * 3 + [MiB] * 6 + [9000]
    assert [off for off, _ in ranges] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert all(off % MiB == 0 for off, _ in ranges)
    assert plan_ranges(0, 4 * MiB, 4, MiB) == []
    assert plan_ranges(MiB // 2, 4 * MiB, 4, MiB) == [(0, MiB // 2)]


def test_no_range_starts_more_than_the_lead_past_a_slow_first_one():
    data = bytes(range(256)) * (24 * MiB // 256)
    ranges = [(off, MiB) for off in range(0, len(data), MiB)]
    backend = HeldBack(data, held=0)
    view = bytearray(len(data))
    landed: list[int] = []
    lock = threading.Lock()

    def note(index: int) -> None:
        with lock:
            landed.append(index)
            if len(landed) == 4:  # everything the lead allows besides the held range
                backend.gate.set()

    reads = PrefixReads(backend.read_into, memoryview(view), ranges, workers=4, lead=5,
                        landed=note)  # fmt: skip
    reads.run()
    assert bytes(view) == data
    assert sorted(landed) == list(range(len(ranges)))
    # While range 0 was held, only ranges 1-4 (the lead) were requested: the others waited
    # instead of racing ahead of the prefix the relays follow.
    assert sorted(backend.requested[:5]) == [off for off, _ in ranges[:5]]
    assert sorted(landed[:4]) == [1, 2, 3, 4] and landed[4] == 0


def test_the_first_error_is_raised_and_no_later_range_starts():
    data = b"x" * (12 * MiB)
    ranges = [(off, MiB) for off in range(0, len(data), MiB)]
    started: list[int] = []

    def read_into(off: int, view: memoryview, progress: Callable[[int], None]) -> None:
        started.append(off)
        if off == 2 * MiB:
            raise OSError("storage went away")
        view[:] = data[off : off + len(view)]

    reads = PrefixReads(read_into, memoryview(bytearray(len(data))), ranges, workers=2,
                        lead=3, landed=lambda i: None)  # fmt: skip
    with pytest.raises(OSError, match="storage went away"):
        reads.run()
    assert max(started) <= 4 * MiB  # the lead past range 2, which never landed


def test_progress_inside_a_slow_first_range_is_reported_before_it_lands():
    """The prefix a relay follows moves inside the first range while it is still landing:
    with several ranges sharing a link the first lands last, and a relay that waited for it
    whole would sit idle meanwhile."""
    data = bytes(range(256)) * (8 * MiB // 256)
    ranges = [(off, 2 * MiB) for off in range(0, len(data), 2 * MiB)]
    backend = HeldBack(data, held=0)
    events: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def landed(index: int) -> None:
        with lock:
            events.append(("landed", index, ranges[index][1]))
            if len([e for e in events if e[0] == "landed"]) == 3:
                backend.gate.set()  # ranges 1-3 are in: let the held one finish

    def progress(index: int, n: int) -> None:
        with lock:
            events.append(("progress", index, n))

    view = bytearray(len(data))
    reads = PrefixReads(backend.read_into, memoryview(view), ranges, workers=4, lead=5,
                        landed=landed, progress=progress)  # fmt: skip
    reads.run()
    assert bytes(view) == data
    first = [e for e in events if e[1] == 0]
    # Half of range 0 was reported while it was held, before it landed.
    assert first == [("progress", 0, MiB), ("progress", 0, 2 * MiB), ("landed", 0, 2 * MiB)]
