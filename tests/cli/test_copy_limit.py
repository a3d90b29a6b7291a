"""The demo's limit row is the save's own copy engine into touched shared memory.

A limit measured with another copy (one ``copy_`` per tensor, ``memmove``) was beaten by a
first save, whose copy streams on several threads: a limit that is beaten is mis-measured.
"""

from __future__ import annotations

import torch

import ckptcache.codec.shm as shm
from ckptcache.cli.benchmarking import copy_limit_label, copy_limit_seconds, make_state
from ckptcache.format.fastcopy import COPY_IMPLEMENTATION


def _mapping_of(address: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` entry of the mapping that holds ``address``: its permissions,
    its file, and its fields (``Rss``, ``Size``, in kB)."""
    with open("/proc/self/smaps") as f:
        entry: dict[str, str] | None = None
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                entry = {"perms": fields[1], "file": fields[5] if len(fields) > 5 else ""}
                entry["hit"] = "1" if lo <= address < hi else ""
            elif entry is not None and entry["hit"] and line.endswith("kB\n"):
                entry[fields[0].rstrip(":")] = fields[1]
                if fields[0] == "Rss:":
                    return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_limit_is_the_saves_copy_engine_into_touched_shared_memory(monkeypatch):
    state = make_state(4 << 20)  # 16 tensors of 256 KiB
    calls: list[list[tuple[int, int, int]]] = []
    destinations: list[dict[str, str]] = []
    real = shm.copy_runs

    def recorded(runs):
        runs = list(runs)
        calls.append(runs)
        if runs and not destinations:  # where the first copy writes, before it writes
            destinations.append(_mapping_of(runs[0][0]))
        real(runs)

    monkeypatch.setattr(shm, "copy_runs", recorded)  # the engine's one native call per share
    assert copy_limit_seconds(state, repeats=2) > 0
    copied = [run for call in calls for run in call]
    storages = {t.untyped_storage().data_ptr(): t.nbytes for t in state.values()}
    # Every byte of every storage went through the engine, once per repeat.
    assert sum(n for _, _, n in copied) == 2 * sum(storages.values())
    for _, src, n in copied:  # from the state's own storages (a share may cut one)
        assert any(p <= src and src + n <= p + size for p, size in storages.items())
    # Into a shared mapping of a tmpfs file, every page resident before the first copy.
    (where,) = destinations
    assert where["perms"].startswith("rw") and where["perms"].endswith("s"), where
    assert where["file"].startswith("/dev/shm/ckptcache-limit-"), where
    assert int(where["Rss"]) >= int(where["Size"]) > 0, where


def test_the_row_names_the_copy_it_measured():
    label = copy_limit_label(512 << 20)
    threads = shm.copy_threads(512 << 20)
    assert label.startswith("copy limit (the save's own copy: ")
    assert f"{COPY_IMPLEMENTATION}, {threads} thread" in label and "into touched memory" in label
    assert torch.get_num_threads() >= threads >= 1
