"""The one temp + rename helper: whole file or nothing, no leftovers, caller-named temps."""

from __future__ import annotations

import os

import pytest

from ckptcache._atomic import atomic_write, publish


def test_replaces_whole_file_and_leaves_no_temp(tmp_path) -> None:
    path = str(tmp_path / "f")
    atomic_write(path, lambda f: f.write(b"old"))
    atomic_write(path, lambda f: f.write(b"new contents"))
    assert (tmp_path / "f").read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["f"]


def test_failed_write_keeps_old_file_and_removes_temp(tmp_path) -> None:
    path = str(tmp_path / "f")
    atomic_write(path, lambda f: f.write(b"old"))

    def boom(f) -> None:
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, boom, tmp=str(tmp_path / ".f.tmp"))
    assert (tmp_path / "f").read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]


def test_exclusive_refuses_an_existing_temp_and_keeps_it(tmp_path) -> None:
    tmp = tmp_path / ".t"
    tmp.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        atomic_write(str(tmp_path / "f"), lambda f: f.write(b"x"), tmp=str(tmp), exclusive=True)
    assert not (tmp_path / "f").exists()


def test_non_exclusive_truncates_a_leftover_temp(tmp_path) -> None:
    tmp = tmp_path / ".t"
    tmp.write_bytes(b"a much longer leftover")
    path = tmp_path / "f"
    atomic_write(str(path), lambda f: f.write(b"x"), tmp=str(tmp), fsync=False)
    assert path.read_bytes() == b"x"
    assert not tmp.exists()


def test_new_temp_gets_the_mode(tmp_path) -> None:
    path = tmp_path / "f"
    atomic_write(str(path), lambda f: f.write(b"x"), mode=0o600)
    assert path.stat().st_mode & 0o777 == 0o600


def test_publish_removes_temp_when_the_move_fails(tmp_path) -> None:
    removed: list[str] = []

    def move(src: str, dst: str) -> None:
        raise PermissionError("read-only")

    with pytest.raises(PermissionError):
        publish("t", "p", lambda name: None, move, removed.append)
    assert removed == ["t"]
