"""A node sends one object to at most FANOUT peers at once; the rest chain behind them."""

from __future__ import annotations

import threading

import pytest

from ckptcache.server.restore import fetching
from ckptcache.server.restore.fetching import FANOUT, PeerBusy, _Sends


def test_a_second_send_of_the_same_object_is_refused_while_the_first_runs():
    sends = _Sends()
    key = ("default", "/ckpt/a.pt")
    with sends.slot(key):
        with (
            pytest.raises(PeerBusy, match=r"already sending '/ckpt/a.pt' to 1 peer"),
            sends.slot(key),
        ):
            pass
        with sends.slot(("default", "/ckpt/b.pt")):  # another object: its own slot
            pass
    with sends.slot(key):  # free again once the first send ended
        pass
    assert FANOUT == 1


def test_a_slot_is_given_back_when_the_send_fails(monkeypatch):
    monkeypatch.setattr(fetching, "FANOUT", 2)
    sends = _Sends()
    key = ("default", "/ckpt/a.pt")
    with pytest.raises(ConnectionError), sends.slot(key):
        raise ConnectionError("peer went away")
    held = threading.Barrier(2)
    release = threading.Event()

    def hold() -> None:
        with sends.slot(key):
            held.wait()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    # Two at once are allowed at FANOUT 2 (the failed one gave its slot back), not three.
    with sends.slot(key), pytest.raises(PeerBusy), sends.slot(key):
        pass
    release.set()
    t.join()
    assert sends._count == {}
