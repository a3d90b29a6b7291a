"""Kill -9 of trainers and of the daemon: committed checkpoints survive, partial ones vanish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object
from ckptcache.wire import messages as m
from tests.helpers import assert_same, wait_until

SAVER = textwrap.dedent(
    """
    import os, signal, sys, torch, ckptcache
    g = torch.Generator().manual_seed(int(sys.argv[2]))
    obj = {"w": torch.randn(256, 1024, generator=g), "step": int(sys.argv[2])}
    ckptcache.save(obj, sys.argv[1])
    os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies right after its save
    """
)


def run_saver(socket: str, path: str, seed: int) -> int:
    env = {**os.environ, "CKPTCACHE_SOCKET": socket}
    return subprocess.run([sys.executable, "-c", SAVER, path, str(seed)], env=env).returncode


def test_trainer_killed_after_save_then_new_process_loads(daemon, tmp_path):
    path = str(tmp_path / "iter_1" / "model.pt")
    assert run_saver(daemon.socket, path, 7) == -signal.SIGKILL
    loader = (
        "import sys, torch, ckptcache; o = ckptcache.load(sys.argv[1], verify=True); "
        "g = torch.Generator().manual_seed(7); "
        "assert torch.equal(o['w'], torch.randn(256, 1024, generator=g)) and o['step'] == 7; "
        "print('OK')"
    )
    env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
    out = subprocess.run(
        [sys.executable, "-c", loader, path], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "OK", out.stderr


def test_daemon_killed_after_commit_restarts_with_everything(daemon, tmp_path):
    objs = {str(tmp_path / f"m{i}.pt"): {"w": torch.randn(1000), "i": i} for i in range(3)}
    with daemon.client() as c:
        for p, o in objs.items():
            c.save(o, p)
    daemon.restart()  # SIGKILL, then a fresh process on the same shm root
    with daemon.client() as c:
        assert sorted(o.path for o in c.list()) == sorted(objs)
        for p, o in objs.items():
            assert_same(o, c.load(p, verify=True))
        c.save({"w": torch.zeros(1)}, next(iter(objs)))  # generations continue after restart
        assert c.status(next(iter(objs))).generation == 2
    assert "recovered" in daemon.log()


def test_daemon_killed_mid_save_reclaims_partial_segment(daemon, tmp_path):
    path = str(tmp_path / "p.pt")
    with daemon.client() as c:
        c.save({"w": torch.ones(100)}, path)  # generation 1, committed
        flat = flatten({"w": torch.zeros(1 << 20)})
        plan = plan_object(flat, path, c.namespace)
        reply = c._connection.call("reserve", m.ReserveRequest(c.namespace, path, plan.layout.nbytes),
                        m.ReserveReply)  # fmt: skip
        # half-copy the new generation, then the daemon dies before commit
        c._saves.mapping(reply.segment, reply.capacity)[4096:8192] = b"\xff" * 4096
    daemon.restart()
    assert not os.path.exists(os.path.join(daemon.segments_dir, reply.segment))
    with daemon.client() as c:
        st = c.status(path)
        assert st.generation == 1
        assert torch.equal(c.load(path, verify=True)["w"], torch.ones(100))
    assert "reclaiming uncommitted segment" in daemon.log()


def test_trainer_killed_mid_save_leaves_nothing_visible(daemon, tmp_path):
    path = str(tmp_path / "q.pt")
    code = textwrap.dedent(
        f"""
        import os, signal, torch, ckptcache
        from ckptcache.wire import messages as m
        c = ckptcache.Client({daemon.socket!r})
        c._connection.call("reserve", m.ReserveRequest(c.namespace, {path!r}, 1 << 20), m.ReserveReply)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == -signal.SIGKILL
    with daemon.client() as c:
        assert not c.exists(path)

        def held_and_free() -> tuple[int, int]:
            st = c.daemon_status()
            return st.segments - st.free_segments, st.free_segments

        # The daemon drops the dead trainer's reservation when it sees its connection close,
        # which may come after this new client's first request. Its segment is free and
        # reusable: the pool makes it the spare for saves of its size (nothing new is made).
        wait_until(lambda: held_and_free() == (0, 1), what="the reservation freed")
        assert held_and_free() == (0, 1)
        assert c.daemon_status().spare_segments == 1


def test_sigterm_handed_to_any_thread_stops_the_daemon(daemon):
    """The kernel may hand a process's SIGTERM to any of its threads; Python runs the handler
    in the main thread only, between bytecodes. A main thread in an unbounded wait then never
    stopped (seen on a busy machine). Here the signal is sent to one worker thread directly."""
    import ctypes

    assert daemon.proc is not None
    pid = daemon.proc.pid
    # The oldest worker: one started with the daemon and alive until it stops (a connection's
    # thread may already be gone by the time the signal is sent).
    workers = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert workers, "the daemon runs worker threads"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.tgkill(pid, workers[0], signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
    assert daemon.proc.wait(timeout=30) == 0
    assert "ckptcache.daemon: stopped" in daemon.log()
    assert not os.path.exists(daemon.socket)
