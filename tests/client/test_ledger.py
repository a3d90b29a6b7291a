"""The ledger: what ``wait()`` with no path waits for, and which saves went straight to storage."""

from __future__ import annotations

from ckptcache.client._ledger import Ledger


def test_the_newest_save_of_a_path_decides_where_it_is():
    ledger = Ledger()
    ledger.committed("/a")
    ledger.committed("/b")
    assert ledger.saved == {"/a", "/b"} and ledger.written_through == set()
    ledger.wrote_through("/a")
    assert ledger.saved == {"/b"} and ledger.written_through == {"/a"}
    ledger.committed("/a")  # cached again: the daemon's answer counts once more
    assert ledger.saved == {"/a", "/b"} and ledger.written_through == set()


def test_a_forked_child_disowns_the_parents_saves():
    ledger = Ledger()
    ledger.committed("/a")
    ledger.wrote_through("/b")
    before = ledger.saved
    ledger.disown()
    assert ledger.saved == set() and ledger.written_through == set()
    assert before == {"/a"}  # new sets: the parent's view is not emptied under it
