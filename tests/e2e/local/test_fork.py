"""A process forked while a thread of it holds a client's lock (a non-blocking save copying,
the spare mapper): the child's ckptcache calls work, and the parent's connection survives."""

from __future__ import annotations

import gc
import os
import signal
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import ckptcache
import ckptcache.api
from tests.e2e.local.test_async_save import copies_held


def run_in_child(body: Callable[[], None], report: Path) -> int:
    """Fork, run ``body`` in the child (a hung child is killed by an alarm) and return the
    child's exit code; its traceback, if any, goes to ``report``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(60)
            body()
            code = 0
        except BaseException:
            report.write_text(traceback.format_exc())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_child_forked_while_the_client_lock_is_held(client, tmp_path):
    parent = str(tmp_path / "parent.pt")
    client.save({"w": torch.arange(8.0)}, parent)
    child = str(tmp_path / "child.pt")
    # What the child inherits of the parent's connection: the connection and its root proxy
    # (the daemon's service object), whose collection asks the daemon to release the object.
    inherited = [client._connection.rpc, client._connection.rpc.root]

    def body() -> None:
        assert client.exists(parent)  # the inherited client
        assert ckptcache.api.default_client() is not client  # one default client per process
        assert ckptcache.exists(parent)
        ckptcache.save({"w": torch.ones(8)}, child)
        assert torch.equal(ckptcache.load(child)["w"], torch.ones(8))
        ckptcache.api.set_default_client(None)  # closes the child's clients...
        client.close()
        gc.collect()  # frees the parent's connection object here (rpyc closes it when freed)
        # Collected as a cycle, the connection and its root proxy are finalised in either
        # order; the proxy first, while the connection lives, asks the daemon to release the
        # parent's root object. Here, that order on purpose.
        conn, _ = inherited
        conn._remote_root = None
        inherited.pop()
        gc.collect()

    with copies_held(client):  # what a save in flight does for the length of its copy
        code = run_in_child(body, tmp_path / "child.log")
    log = tmp_path / "child.log"
    assert code == 0, log.read_text() if log.exists() else f"child exit {code}"
    # ... and the parent's connection, which the child shared, still works.
    assert torch.equal(client.load(parent)["w"], torch.arange(8.0))
    assert torch.equal(client.load(child)["w"], torch.ones(8))
