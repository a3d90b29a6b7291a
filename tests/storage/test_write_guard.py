"""Newest wins without clocks: :class:`WriteGuard` and what a file's version says."""

from __future__ import annotations

import os

import pytest

from ckptcache.storage.base import (
    AlreadyStored,
    NewerObjectExists,
    StorageConflict,
    StoredVersion,
    WriteGuard,
)
from ckptcache.storage.fs import FileBackend, file_version

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
    with pytest.raises(NewerObjectExists, match="newer generation saved on this node"):
        WriteGuard(stamp_ns=8, base="x", newer=frozenset({9})).check("p", newer)


def test_an_object_with_this_generations_stamp_is_this_generation_written_already():
    """A retry whose first try landed (its reply lost), or a standby after the representative
    wrote: the object is complete on storage and is not written a second time. A foreign file
    whose time happens to equal the stamp is no ckptcache write: replaced as before."""
    for guard in (WriteGuard(stamp_ns=8, base="x"), WriteGuard(stamp_ns=8), WriteGuard(8, "")):
        with pytest.raises(AlreadyStored, match="holds this generation already"):
            guard.check("p", StoredVersion(8, "c", by_ckptcache=True))
        guard.check("p", StoredVersion(8, "c", by_ckptcache=False))


def test_a_file_an_earlier_attempt_named_is_written_again(tmp_path):
    """The file backend writes a file of this generation again: the attempt that named it
    failed, maybe at its directory's fsync, whose error a new descriptor's fsync would not
    report. Only a new write and its own fsyncs prove the file durable."""
    target = tmp_path / "a.pt"
    guard = WriteGuard(stamp_ns=HOUR, base="")
    body = b"x" * 10_000 + b"archive/.ckptcache/digests.json" + b"y" * 200
    _write(tmp_path, target, body, guard)
    first = file_version(str(target))
    assert first is not None and first.stamp_ns == HOUR and first.by_ckptcache
    again = b"z" * 10_000 + b"archive/.ckptcache/digests.json" + b"y" * 200
    _write(tmp_path, target, again, guard)
    assert target.read_bytes() == again
    second = file_version(str(target))
    assert second is not None and second.stamp_ns == HOUR and second.identity != first.identity
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".a.pt")] == []


def _write(tmp_path, target, data: bytes, guard: WriteGuard) -> None:
    source = tmp_path / "source"
    source.write_bytes(data)
    fd = os.open(source, os.O_RDONLY)
    try:
        FileBackend().write(str(target), fd, 0, len(data), guard=guard)
    finally:
        os.close(fd)


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
