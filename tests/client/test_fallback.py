"""The write-through fallback, without a daemon: the file written whole, each write counted,
reported once per cause, and the client's ``fallback="raise"`` honoured."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from ckptcache.client._fallback import WriteThrough
from ckptcache.client._ledger import Ledger
from ckptcache.client._settings import Settings
from ckptcache.errors import BudgetExceeded, CkptCacheWarning, DaemonUnavailable


class NoDaemon:
    """A connection whose every request finds no daemon."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def call(self, kind, message, reply_type=None):
        self.calls.append(kind)
        raise DaemonUnavailable("no daemon")


def make(tmp_path, fallback: str = "write-through"):
    settings = Settings(str(tmp_path / "none.sock"), True, "default", 5.0, fallback, None)
    connection, ledger = NoDaemon(), Ledger()
    return WriteThrough(settings, connection, ledger), connection, ledger  # type: ignore[arg-type]


def test_writes_are_whole_counted_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTCACHE_FALLBACK_LOG_EVERY", "2")
    wt, connection, ledger = make(tmp_path)
    path = str(tmp_path / "step_1.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            wt.write({"w": torch.full((4,), float(i))}, path, DaemonUnavailable("gone"))
    assert wt.count == 3
    assert torch.equal(torch.load(path)["w"], torch.full((4,), 2.0))
    assert ledger.written_through == {path} and ledger.saved == set()
    assert connection.calls == ["supersede"] * 3  # older generations dropped, daemon or not
    # One warning for the cause, however many writes.
    assert [type(w.message) for w in caught] == [CkptCacheWarning]
    assert "straight to storage" in str(caught[0].message)


def test_repeats_are_logged_every_nth(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CKPTCACHE_FALLBACK_LOG_EVERY", "2")
    wt, _, _ = make(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with caplog.at_level(logging.WARNING, logger="ckptcache.client"):
            for i in range(5):
                wt.write({"i": i}, str(tmp_path / f"{i}.pt"), DaemonUnavailable("gone"))
    lines = [r.getMessage() for r in caplog.records if "written through" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("ckptcache: 2 save(s)")  # writes 2 and 4


def test_each_cause_warns_once(tmp_path):
    wt, _, _ = make(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wt.write({}, str(tmp_path / "a.pt"), DaemonUnavailable("gone"))
        wt.write({}, str(tmp_path / "b.pt"), BudgetExceeded("full"))
        wt.write({}, str(tmp_path / "c.pt"), BudgetExceeded("full"))
    assert len(caught) == 2 and wt.count == 3


def test_raise_writes_nothing(tmp_path):
    wt, connection, ledger = make(tmp_path, fallback="raise")
    path = tmp_path / "step_1.pt"
    with pytest.raises(DaemonUnavailable, match="gone"):
        wt.write({"x": 1}, str(path), DaemonUnavailable("gone"))
    assert not path.exists() and wt.count == 0
    assert connection.calls == [] and ledger.written_through == set()


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    wt, _, ledger = make(tmp_path)
    path = tmp_path / "step_1.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wt.write({"v": 1}, str(path), DaemonUnavailable("gone"))

        class Mutated:
            def check(self) -> None:
                raise RuntimeError("mutated")

        with pytest.raises(RuntimeError, match="mutated"):
            wt.write({"v": 2}, str(path), DaemonUnavailable("gone"), check=Mutated())  # type: ignore[arg-type]
    assert torch.load(path) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1.pt"]
    assert ledger.written_through == {str(path)}
