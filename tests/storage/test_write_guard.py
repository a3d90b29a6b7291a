"""Newest wins without clocks: :class:`WriteGuard` and what a file's version says."""

from __future__ import annotations

import pytest

from ckptcache.storage.base import (
    NewerObjectExists,
    StorageConflict,
    StoredVersion,
    WriteGuard,
)
from ckptcache.storage.fs import file_version

HOUR = 3600 * 10**9
THERE = StoredVersion(stamp_ns=5 * HOUR, identity="1:2:3:4", by_ckptcache=True)


def test_an_object_that_was_there_at_save_time_is_replaced_whatever_the_stamps():
    WriteGuard(stamp_ns=1, base=THERE.identity).check("p", THERE)  # clock far behind
    WriteGuard(stamp_ns=1, base="").check("p", None)  # nothing there, nothing was


@pytest.mark.parametrize("by_ckptcache", [True, False], ids=["ckptcache", "foreign"])
def test_an_object_written_after_the_save_is_never_replaced(by_ckptcache):
    later = StoredVersion(stamp_ns=1, identity="9:9:9:9", by_ckptcache=by_ckptcache)
    guard = WriteGuard(stamp_ns=10 * HOUR, base=THERE.identity)  # clock far ahead
    expected = StorageConflict if by_ckptcache else NewerObjectExists
    with pytest.raises(expected):
        guard.check("p", later)


def test_this_daemons_own_writes_order_by_generation():
    older, newer = StoredVersion(7, "a", True), StoredVersion(9, "b", True)
    WriteGuard(stamp_ns=8, base="x", own=frozenset({7})).check("p", older)
    WriteGuard(stamp_ns=8, base="x").check("p", StoredVersion(8, "c", True))  # its own retry
    with pytest.raises(NewerObjectExists, match="newer generation saved on this node"):
        WriteGuard(stamp_ns=8, base="x", newer=frozenset({9})).check("p", newer)


def test_without_a_base_the_stamps_decide():
    with pytest.raises(NewerObjectExists):
        WriteGuard(stamp_ns=THERE.stamp_ns - 1).check("p", THERE)
    WriteGuard(stamp_ns=THERE.stamp_ns + 1).check("p", THERE)


def test_file_version_tells_a_ckptcache_archive_from_a_foreign_file(tmp_path):
    ours, foreign, folder = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "d"
    ours.write_bytes(b"x" * 10_000 + b"archive/.ckptcache/digests.json" + b"y" * 200)
    foreign.write_bytes(b"x" * 10_000)
    folder.mkdir()
    a, b = file_version(str(ours)), file_version(str(foreign))
    assert a is not None and a.by_ckptcache
    assert b is not None and not b.by_ckptcache and a.identity != b.identity
    assert file_version(str(folder)) is None and file_version(str(tmp_path / "none")) is None
    quick = file_version(str(ours), inspect=False)
    assert quick is not None and quick.identity == a.identity and not quick.by_ckptcache


def test_a_save_the_cluster_ordered_before_this_one_is_replaced_whenever_it_landed():
    """``seen``: the newest save of the path, cluster-wide, when this one began. A ckptcache
    object stamped no later is that save (or an older one) persisted after this one began:
    older, replaced; one stamped later, or a foreign write, is not."""
    guard = WriteGuard(stamp_ns=20, base="", seen=12)
    guard.check("p", StoredVersion(12, "k", by_ckptcache=True))
    guard.check("p", StoredVersion(3, "k", by_ckptcache=True))
    with pytest.raises(StorageConflict):  # made after this save began: only clocks order it
        guard.check("p", StoredVersion(13, "k", by_ckptcache=True))
    with pytest.raises(NewerObjectExists):  # a foreign write is never ordered by stamps
        guard.check("p", StoredVersion(12, "k", by_ckptcache=False))
    with pytest.raises(StorageConflict):  # not known (-1): as before
        WriteGuard(stamp_ns=20, base="").check("p", StoredVersion(12, "k", by_ckptcache=True))
