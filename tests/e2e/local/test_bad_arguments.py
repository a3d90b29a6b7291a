"""Bad arguments get a clear, typed error at the call that took them (not a raw error from
deep inside, or later on a background thread), and lose nothing."""

from __future__ import annotations

import math

import pytest
import torch

import ckptcache
from ckptcache.errors import NameTooLong, ParentNotADirectory, PathIsADirectory, PersistTimeout


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"timeout": -1}, ValueError),
        ({"timeout": math.nan}, ValueError),
        ({"timeout": math.inf}, ValueError),
        ({"timeout": 0}, ValueError),
        ({"timeout": "5"}, TypeError),
        ({"namespace": 5}, TypeError),
        ({"socket_path": 5}, TypeError),
        ({"daemon_uid": -3}, TypeError),
    ],
    ids=repr,
)
def test_a_client_refuses_bad_settings_as_it_is_made(settings, error):
    with pytest.raises(error) as raised:
        ckptcache.Client(**settings)
    assert next(iter(settings)) in str(raised.value)


def test_timeouts_of_waits_are_checked(daemon, tmp_path):
    path = str(tmp_path / "w.pt")
    with daemon.client() as c:
        handle = c.save({"w": torch.ones(4)}, path, blocking=False)
        for bad, error in (("1", TypeError), (-1.0, ValueError), (math.nan, ValueError)):
            with pytest.raises(error, match="timeout"):
                handle.wait(bad)
            with pytest.raises(error, match="timeout"):
                c.wait(path, timeout=bad)
        handle.wait(math.inf)  # no limit
        assert torch.equal(c.load(path)["w"], torch.ones(4))


def test_a_save_not_finished_within_its_timeout_says_so(daemon, tmp_path):
    path = str(tmp_path / "slow.pt")
    with daemon.client() as c:
        c.save({"w": torch.zeros(4)}, path)  # connected, planned
        with c._connection.lock:  # the save thread waits for the connection meanwhile
            handle = c.save({"w": torch.ones(4)}, path, blocking=False)
            with pytest.raises(PersistTimeout, match="did not finish within 0 s"):
                handle.wait(0)
        handle.wait()
        assert torch.equal(c.load(path)["w"], torch.ones(4))


def test_stage_takes_a_list_of_tensors_with_bytes(daemon):
    with daemon.client() as c:
        with pytest.raises(TypeError, match="list or tuple of tensors, not Tensor"):
            c.stage(torch.ones(3, 2))
        with pytest.raises(TypeError, match="meta device"):
            c.stage([torch.ones(2), torch.empty(3, device="meta")])
        staged = c.stage([torch.arange(6.0)])
        assert torch.equal(staged.tensors[0], torch.arange(6.0))
        staged.release()


def test_a_write_through_the_path_refuses_raises_the_daemons_error(tmp_path):
    """No daemon: the save is written through with torch.save, and a path that could never
    be written raises what a save through the daemon raises, not a raw OSError naming a
    temporary file."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_bytes(b"x")
    client = ckptcache.Client(str(tmp_path / "no-daemon.sock"), fallback="write-through")
    cases = (
        (tmp_path / "adir", PathIsADirectory),
        (tmp_path / "afile" / "x.pt", ParentNotADirectory),
        (tmp_path / ("n" * 300 + ".pt"), NameTooLong),
    )
    with pytest.warns(ckptcache.CkptCacheWarning):
        for path, error in cases:
            with pytest.raises(error, match="cannot save"):
                client.save({"w": torch.ones(2)}, str(path))
    assert (tmp_path / "afile").read_bytes() == b"x"
    client.close()
