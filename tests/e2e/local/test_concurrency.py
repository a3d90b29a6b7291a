"""Two writers of one path: one generation wins whole, never a mix."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import torch

import ckptcache
from ckptcache.format.digest import digest_bytes

WRITER = textwrap.dedent(
    """
    import sys, torch, ckptcache
    fill = float(sys.argv[2])
    for i in range(15):
        ckptcache.save({"a": torch.full((1 << 20,), fill), "b": torch.full((1 << 19,), fill)}, sys.argv[1])
    """
)


def test_concurrent_writers_never_mix(daemon, tmp_path):
    path = str(tmp_path / "same.pt")
    env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, path, str(v)], env=env) for v in (1, 2)
    ]
    seen = set()
    with daemon.client() as c:
        while any(p.poll() is None for p in procs):
            if c.exists(path):
                out = c.load(path, mmap=False)
                values = {out["a"][0].item(), out["a"][-1].item(), out["b"][-1].item()}
                assert len(values) == 1, values  # every tensor from the same writer
                seen |= values
        assert [p.wait() for p in procs] == [0, 0]
        final = c.load(path, verify=True)
        fill = final["a"][0].item()
        expected = torch.full((1 << 20,), fill)
        assert digest_bytes(final["a"].numpy().tobytes()) == digest_bytes(
            expected.numpy().tobytes()
        )
        assert c.status(path).generation == 30
    assert seen <= {1.0, 2.0}


def test_a_thread_waiting_for_persistence_holds_up_no_other_call(client, tmp_path):
    """``wait`` blocks in the daemon (up to 30 s per request): the trainer's saves and loads on
    the same client go on meanwhile (the wait has a connection of its own)."""
    waiting, release = threading.Event(), threading.Event()
    waiter = client._connection.waiting()
    request = waiter.request

    def held_in_the_daemon(kind, message, reply_type=None):
        if kind == "wait":
            waiting.set()
            release.wait(60)  # as a persist that takes long
        return request(kind, message, reply_type)

    waiter.request = held_in_the_daemon
    first, second = str(tmp_path / "first.pt"), str(tmp_path / "second.pt")
    client.save({"w": torch.ones(8)}, first)
    outcome: list[BaseException | None] = []

    def wait_for_first() -> None:
        try:
            client.wait(first, timeout=120)
            outcome.append(None)
        except Exception as e:  # the daemon has no persist root: memory-only, reported
            outcome.append(e)

    thread = threading.Thread(target=wait_for_first)
    thread.start()
    try:
        assert waiting.wait(60)
        client.save({"w": torch.full((8,), 2.0)}, second)  # would queue behind the wait
        assert torch.equal(client.load(second)["w"], torch.full((8,), 2.0))
        assert client.exists(first)
        assert thread.is_alive() and not outcome  # all of it while the wait was in the daemon
    finally:
        release.set()
        thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], ckptcache.errors.PathNotAllowed)
