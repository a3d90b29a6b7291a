"""A save that copies only what changed, on a real daemon: storages the kernel proves unwritten
since the save whose bytes the handed segment holds are not copied, and every load, every
persisted file and every later save still holds the trainer's bytes exactly, whatever wrote
the tensors (writes no version counter sees included), whoever used the segment meanwhile,
and whatever changed a free segment's bytes."""

from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys

import pytest
import torch

from ckptcache.errors import CorruptCheckpoint
from tests.helpers import metric, wait_until

MiB = 1 << 20


def lora(seed: int = 0) -> dict:
    """A frozen base of four 2 MiB tensors, small adapters and an optimizer step count."""
    g = torch.Generator().manual_seed(seed)
    return {
        "base": {f"layer{i}": torch.randn(2 * MiB // 4, generator=g) for i in range(4)},
        "adapter": {f"layer{i}": torch.randn(4096, generator=g) for i in range(4)},
        "step": 0,
    }


def step(state: dict) -> None:
    """A training step: only the adapters and the step count change."""
    for t in state["adapter"].values():
        t.add_(0.5)
    state["step"] += 1


def equal(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a[part][k], b[part][k]) for part in ("base", "adapter") for k in a[part]
    )


def until_skipped(client, state: dict, path: str, most: int = 12) -> int:
    """Train and save until a save skipped something (a bounded number of saves: a segment
    is trusted once the daemon has checked it, in the background, after it was freed)."""
    for _ in range(most):
        step(state)
        save_and_check(client, state, path)
        if client._saves.unchanged.skipped:
            return client._saves.unchanged.skipped
    raise AssertionError(f"no save of {most} skipped anything")


def save_and_check(client, state: dict, path: str) -> None:
    """Save, then load back a private copy, verified, and wait until the daemon's background
    work is done: the generation digested (which checks what the save kept) and the segment
    it freed checked. A trainer's saves come minutes apart; saves back to back would take
    each freed segment before its check, and so skip nothing."""
    client.save(state, path)
    assert equal(client.load(path, mmap=False, verify=True), state)
    wait_until(lambda: client.status(path).digests_valid, 60, "the digests")
    wait_until(lambda: client.daemon_status().digest_queue == 0, 60, "the background work")


@pytest.fixture
def persisting(daemon_factory, tmp_path):
    return daemon_factory("--persist-root", str(tmp_path), "--metrics-port", "0")


def counter(d, series: str) -> float:
    """The daemon's counter ``series``, 0 before its first count."""
    return metric(d, series) or 0.0


def test_repeated_saves_skip_the_frozen_base_and_every_copy_is_exact(persisting, tmp_path):
    path = str(tmp_path / "job" / "model.pt")
    state = lora()
    with persisting.client() as trainer:
        skipped = until_skipped(trainer, state, path)
        # The whole base, every time: nothing of it changes.
        assert skipped % sum(t.untyped_storage().nbytes() for t in state["base"].values()) == 0
        # The daemon counts what the saves kept, and the freed segments it checked.
        assert counter(persisting, "ckptcache_save_bytes_kept_total") == skipped
        assert counter(persisting, 'ckptcache_free_checks_total{result="equal"}') >= 1
        trainer.wait(path, timeout=60)
    assert equal(torch.load(path, weights_only=True), state)


WRITES = {
    ".data": lambda t: t.data[100_000].fill_(7.0),
    "numpy": lambda t: t.numpy().__setitem__(200_000, -3.0),
    "inference mode": lambda t: torch.inference_mode()(t.__setitem__)(300_000, 1.5),
    "dlpack": lambda t: torch.from_dlpack(t)[400_000].fill_(2.5),
    "copy_ of another tensor": lambda t: t.copy_(torch.full_like(t, 0.25)),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_a_write_to_a_frozen_tensor_is_saved(persisting, tmp_path, how):
    """Writes to the frozen base (the counter may not move) between saves: each later load
    and the persisted file hold them."""
    path = str(tmp_path / "job" / "model.pt")
    state = lora()
    with persisting.client() as trainer:
        until_skipped(trainer, state, path)
        for i in range(6):
            step(state)
            if i in (1, 3):
                WRITES[how](state["base"][f"layer{i}"])
            save_and_check(trainer, state, path)
        trainer.wait(path, timeout=60)
    assert equal(torch.load(path, weights_only=True), state)


def test_a_segment_another_trainer_used_is_written_whole(persisting, tmp_path):
    """Two trainers of one user save states of one size in turn, so the daemon hands each the
    segments the other wrote: no token matches, nothing of the other's bytes is kept."""
    a_path, b_path = str(tmp_path / "a" / "model.pt"), str(tmp_path / "b" / "model.pt")
    a, b = lora(1), lora(2)
    with persisting.client() as ta, persisting.client() as tb:
        for _ in range(6):
            step(a)
            save_and_check(ta, a, a_path)
            step(b)
            save_and_check(tb, b, b_path)
            # Either drops its newest: the next saves take freed segments, often the other's.
            ta.delete(a_path)
            tb.delete(b_path)
            save_and_check(ta, a, a_path)
            save_and_check(tb, b, b_path)
        ta.wait(a_path, timeout=60)
        tb.wait(b_path, timeout=60)
    assert equal(torch.load(a_path, weights_only=True), a)
    assert equal(torch.load(b_path, weights_only=True), b)


def _pin(nbytes: int):
    """A real io_uring with a fixed buffer of ``nbytes`` registered: memory the kernel may
    write through its pin, past the page tables (``VmPin`` counts it). Its descriptor; the
    caller closes it. Skips the test where the kernel refuses io_uring."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(425, 4, params)  # io_uring_setup
    if fd < 0:
        pytest.skip(f"io_uring refused here: {os.strerror(ctypes.get_errno())}")
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    iov = (ctypes.c_uint64 * 2)(buffer.data_ptr(), nbytes)
    if libc.syscall(427, fd, 0, iov, 1) < 0:  # io_uring_register(IORING_REGISTER_BUFFERS)
        err = ctypes.get_errno()
        os.close(fd)
        pytest.skip(f"io_uring buffers refused here: {os.strerror(err)}")
    return fd, buffer


def _vm_pin() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmPin:"))


def test_memory_pinned_for_the_kernel_skips_nothing(persisting, tmp_path):
    """While memory of the process is pinned (io_uring fixed buffers, RDMA regions: their
    writes pass the page tables), a save skips nothing, and neither does the save after the
    pin went; then skipping resumes."""
    path = str(tmp_path / "job" / "model.pt")
    state = lora()
    with persisting.client() as trainer:
        until_skipped(trainer, state, path)
        fd, buffer = _pin(1 << 20)
        assert _vm_pin() > 0
        skipped = trainer._saves.unchanged.skipped
        for _ in range(3):
            step(state)
            save_and_check(trainer, state, path)
        assert trainer._saves.unchanged.skipped == skipped
        os.close(fd)
        del buffer
        wait_until(lambda: _vm_pin() == 0, 30, "the pin gone")  # a ring ends in the background
        step(state)
        save_and_check(trainer, state, path)
        assert trainer._saves.unchanged.skipped == skipped  # the save after the pin
        # Saves that trusted nothing found no write: the storages stay watched and skipped
        # again soon (not retired as often written, which would take REST saves).
        for _ in range(8):
            step(state)
            save_and_check(trainer, state, path)
            if trainer._saves.unchanged.skipped > skipped:
                break
        assert trainer._saves.unchanged.skipped > skipped


def test_one_client_of_a_process_watches(persisting, tmp_path):
    """Two watches in one process would take each other's writes (a scan protects again
    whatever it reports): the second client copies every storage, and the first still sees
    every write, whatever the second saved meanwhile; once the first closes, the second
    watches."""
    a_path, b_path = str(tmp_path / "a" / "model.pt"), str(tmp_path / "b" / "model.pt")
    state = lora()
    first = persisting.client()
    with persisting.client() as second:
        until_skipped(first, state, a_path)
        own = lora(1)  # tensors of its own: the first one's are registered by the first
        for _ in range(12):  # more saves than it takes a watching client to skip
            step(own)
            save_and_check(second, own, b_path)
        assert second._saves.unchanged.skipped == 0
        for i in range(4):
            step(state)
            state["base"][f"layer{i}"][1000 * i : 1000 * i + 5000] += 1.0  # a frozen one too
            save_and_check(second, state, b_path)
            save_and_check(first, state, a_path)
        assert second._saves.unchanged.skipped == 0
        first.wait(a_path, timeout=60)
        assert equal(torch.load(a_path, weights_only=True), state)
        first.close()
        assert until_skipped(second, own, b_path) > 0


_C_FORK = """
import ctypes, faulthandler, os, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[3])
from tests.e2e.local.test_skip_unchanged import equal, lora, save_and_check, step, until_skipped
from ckptcache import Client
from ckptcache._workers import join_started
fork = ctypes.PyDLL(None).fork  # no fork handler of Python's runs
fork.restype = ctypes.c_int
client = Client(sys.argv[1], fallback="raise")
state, path = lora(), sys.argv[2]
until_skipped(client, state, path)
for i in range(3):
    state["base"]["layer3"][50_000 + i : 60_000] += 1.0
    # No thread of the client's may hold a lock at the fork (only the forking thread goes
    # on in the child): the spare thread and the plans read ahead end first.
    client._saves._ahead_stop.set()  # the plans read ahead
    join_started(client._saves._ahead_thread)
    client._parts.plans.stop()  # the plans of the job's earlier saves
    client._spares.stop()
    client._spares.join()
    pid = fork()
    if pid == 0:
        code = 1
        try:
            faulthandler.dump_traceback_later(60, exit=True)  # a hang fails, with its stack
            client.save({"w": state["base"]["layer3"]}, path + f".child{i}")
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    step(state)
    save_and_check(client, state, path)  # raises where a load is stale
client.wait(path, timeout=60)
client.close()
print("EQUAL" if equal(torch.load(path, weights_only=True), state) else "STALE")
"""


def test_a_child_forked_without_fork_handlers_leaves_the_parents_watch_alone(persisting, tmp_path):
    """A child made by a C library's ``fork()`` inherits descriptors that name the parent's
    memory: its save forgets them, and the parent's next save still sees the parent's
    writes (the child's scan would have taken them)."""
    path = str(tmp_path / "job" / "model.pt")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _C_FORK, persisting.socket, path, root],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "EQUAL"


def same_experts(a: dict, b: dict) -> bool:
    return len(a["experts"]) == len(b["experts"]) and all(
        torch.equal(x, y) for x, y in zip(a["experts"], b["experts"], strict=True)
    )


def experts(seed: int, mib: int = 2) -> dict:
    """Eight experts of ``mib`` MiB and a step count."""
    g = torch.Generator().manual_seed(seed)
    return {"experts": [torch.randn(mib * MiB // 4, generator=g) for _ in range(8)], "step": 0}


def touch_and_save(
    trainer, state: dict, path: str, touched: list[int], durability: str = "memory"
) -> int:
    """Train the experts ``touched``, save, load back verified; the bytes the save kept."""
    for e in touched:
        state["experts"][e].add_(1.0)
    state["step"] += 1
    before = trainer._saves.unchanged.skipped
    trainer.save(state, path, durability=durability)
    kept = trainer._saves.unchanged.skipped - before
    loaded = trainer.load(path, mmap=False, verify=True)
    assert loaded["step"] == state["step"] and same_experts(loaded, state)
    return kept


def test_a_save_copies_only_what_changed_since_the_save_before(persisting, tmp_path):
    """Experts touched in turn (two of eight per step): the daemon keeps two generations, so
    the segment a save is handed held the save three before; once saves pause, the daemon
    copies the newest save into it and hands it out under that save's token. From then on
    each save copies exactly the experts touched since the save before it, and every load
    and the persisted file hold the trainer's bytes. (The saves are memory only, so that
    each from the third frees a segment at its commit, not once persisted.)"""
    path = str(tmp_path / "job" / "model.pt")
    state = experts(3)
    equal_checks = 'ckptcache_free_checks_total{result="equal"}'
    skipped_each = []
    with persisting.client() as trainer:
        for i in range(9):
            skipped_each.append(touch_and_save(trainer, state, path, [i % 8, (i + 3) % 8]))
            # Every segment freed so far refilled and checked before the next save.
            wait_until(lambda n=i - 1: counter(persisting, equal_checks) >= n, 60,
                       "the freed segments to be refilled and checked")  # fmt: skip
        trainer.save(state, path)
        trainer.wait(path, timeout=60)
    # From the fourth save on: six untouched experts kept, every time (three saves' worth of
    # touched experts would leave at most two).
    assert skipped_each[3:] == [6 * 2 * MiB] * 6
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == state["step"] and same_experts(saved, state)


def test_a_checkpoint_per_step_copies_only_what_changed_since_the_step_before(persisting, tmp_path):
    """The frameworks' way: every step's checkpoint under a new path, the one two steps back
    deleted. The freed segment gets the newest step's bytes (another path, the same layout),
    so each save from the fourth copies exactly the experts touched since the step before."""
    state = experts(4)
    equal_checks = 'ckptcache_free_checks_total{result="equal"}'
    skipped_each = []

    def path(i: int) -> str:
        return str(tmp_path / "job" / f"step-{i}" / "model.pt")

    with persisting.client() as trainer:
        for i in range(9):
            skipped_each.append(touch_and_save(trainer, state, path(i), [i % 8, (i + 5) % 8]))
            if i >= 2:
                trainer.delete(path(i - 2))
                wait_until(lambda n=i - 1: counter(persisting, equal_checks) >= n, 60,
                           "the freed segments to be refilled and checked")  # fmt: skip
    assert skipped_each[3:] == [6 * 2 * MiB] * 6


def test_saves_that_arrive_while_the_daemon_copies_into_their_segment_hold_their_bytes(
    persisting, tmp_path
):
    """Saves at random short intervals, so that a reservation often takes a freed segment the
    daemon is still copying the newest save into (the copy stops first, and the segment
    comes without a token): every load, verified, holds the trainer's bytes."""
    import random
    import time

    rng = random.Random(7)
    path = str(tmp_path / "job" / "model.pt")
    state = experts(5, mib=8)
    with persisting.client() as trainer:
        for _ in range(24):
            touch_and_save(trainer, state, path, rng.sample(range(8), 2), durability="local")
            time.sleep(rng.choice((0.0, 0.005, 0.02, 0.05, 0.3)))
        trainer.wait(path, timeout=60)
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == state["step"] and same_experts(saved, state)


def test_nothing_is_skipped_after_the_daemon_restarts(daemon_factory, tmp_path):
    """Tokens live in the daemon's memory: after a kill -9 and a restart, the segments it
    adopts name no bytes, and the first saves copy everything."""
    d = daemon_factory("--persist-root", str(tmp_path))
    path = str(tmp_path / "job" / "model.pt")
    state = lora()
    with d.client() as trainer:
        before = until_skipped(trainer, state, path)
        d.kill()
        d.restart()
        for _ in range(2):  # the two generations adopted are not replaced before these
            step(state)
            state["base"]["layer0"].data[5] = float(state["step"])  # and the base changes
            # (The first save after the restart may find the connection gone and write the
            # file through: no digests to wait for then.)
            trainer.save(state, path)
            assert equal(trainer.load(path, mmap=False, verify=True), state)
        assert trainer._saves.unchanged.skipped == before
        trainer.wait(path, timeout=60)
    assert equal(torch.load(path, weights_only=True), state)


def _flip_free_segments(daemon, live: set[str]) -> int:
    """Write into the middle of every free segment (one a save may be handed next)."""
    flipped = 0
    for seg in glob.glob(os.path.join(daemon.segments_dir, "seg-*")):
        if os.path.basename(seg) in live:
            continue
        with open(seg, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size < 8 * MiB:
                continue
            f.seek(size // 2)
            f.write(b"\xde\xad\xbe\xef" * 1024)
            flipped += 1
    return flipped


def test_bytes_changed_in_a_free_segment_are_never_served(persisting, tmp_path):
    """Every segment but the newest save's written behind the daemon's back. One checked
    before the write: a save that kept storages from it is refused when its digests are taken
    (a load raises, typed, and it is not persisted). One checked after (the previous save's,
    freed by retention a save later, among them): never handed out as holding anything.
    Every load that returns holds the trainer's bytes, and the damage is always reported."""
    path = str(tmp_path / "job" / "model.pt")
    state = lora()
    with persisting.client() as trainer:
        until_skipped(trainer, state, path)
        live = {trainer.status(path).segment}
        assert _flip_free_segments(persisting, live) >= 1
        refused = 0
        for i in range(6):
            step(state)
            trainer.save(state, path)
            try:
                loaded = trainer.load(path, mmap=False, verify=True)
            except CorruptCheckpoint as e:
                assert "changed in memory since it was checked" in str(e)
                assert e.tier == "local"
                refused += 1
            else:
                assert equal(loaded, state)
            if i == 0:
                # The previous save's segment was written too: its check, once retention
                # freed it (at this save), reports it. The check runs in the background and
                # a save that takes the segment first ends it (the save then writes it
                # whole): no save until it is done.
                wait_until(
                    lambda r=refused: r or "does not hold the bytes of" in persisting.log(), 60,
                    "the damage to be reported",
                )  # fmt: skip
        changed = 'ckptcache_free_checks_total{result="changed"}'
        assert refused or counter(persisting, changed) >= 1
        # Later saves are whole again where needed: the newest save loads exactly.
        for _ in range(4):
            step(state)
            save_and_check(trainer, state, path)
        trainer.wait(path, timeout=60)
    assert equal(torch.load(path, weights_only=True), state)


TRAINER = """
import sys, torch, ckptcache
sys.path.insert(0, sys.argv[3])
from test_skip_unchanged import lora, step
state, c = lora(), ckptcache.Client(sys.argv[1])
while True:
    step(state)
    c.save(state, sys.argv[2])
    print(state["step"], flush=True)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_trainer_killed_mid_save_loses_nothing_acknowledged(persisting, tmp_path, seed):
    """A trainer saving (and skipping) in a loop is killed with SIGKILL at a random moment:
    the newest generation is at least the last save that returned, and holds exactly that
    step's state."""
    import random
    import signal
    import subprocess
    import sys
    import time

    path = str(tmp_path / "job" / "model.pt")
    here = os.path.dirname(__file__)
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, persisting.socket, path, here],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    acknowledged = 0
    rng = random.Random(seed)
    stop_after = rng.randint(6, 14)
    assert proc.stdout is not None
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= stop_after:
            break
    time.sleep(rng.uniform(0.0, 0.05))  # somewhere in the next save
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with persisting.client() as c:
        loaded = c.load(path, mmap=False, verify=True)
    assert loaded["step"] >= acknowledged
    expected = lora()
    for _ in range(loaded["step"]):
        step(expected)
    assert equal(loaded, expected)
