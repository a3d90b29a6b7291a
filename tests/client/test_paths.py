"""Checkpoint names: what every part of the client makes of a path before asking the daemon."""

from __future__ import annotations

import os
import pathlib

import pytest

from ckptcache.client._paths import (
    complete_in_storage,
    in_storage,
    is_url,
    normalize_path,
    object_path,
)
from ckptcache.errors import InvalidPath, PathNotAllowed


def test_a_local_path_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize_path("ckpt/step_1.pt") == str(tmp_path / "ckpt" / "step_1.pt")
    assert normalize_path(pathlib.Path("a.pt")) == str(tmp_path / "a.pt")
    assert normalize_path("file:///x/y.pt") == "/x/y.pt"
    assert normalize_path("/x/./y.pt") == "/x/y.pt"


def test_two_leading_slashes_are_one():
    """Linux reads ``//x`` as ``/x``: one file, one name (a save under either is one object)."""
    assert normalize_path("//x/y.pt") == "/x/y.pt" == normalize_path("///x/y.pt")


@pytest.mark.parametrize("directory", ["/run/ckpt.pt/", "/run/ckpt.pt/.", "run/"])
def test_an_object_path_naming_a_directory_is_refused(directory):
    """``torch.save(obj, "ckpt.pt/")`` raises: a save must not land on ``ckpt.pt`` instead
    (writing over the checkpoint there)."""
    with pytest.raises(InvalidPath, match="ends in a separator"):
        object_path(directory)
    assert object_path("/run/ckpt.pt") == "/run/ckpt.pt"
    assert normalize_path("/run/ckpt/") == "/run/ckpt"  # a prefix may end in one


def test_a_url_is_kept_as_given():
    assert normalize_path("s3://bucket/run/step_1.pt") == "s3://bucket/run/step_1.pt"
    assert is_url("s3://bucket/k") and not is_url("/local/k")


@pytest.mark.parametrize("bad", ["", "a\x00b", 3, None, b"/bytes/path"])
def test_what_is_not_a_path_is_refused(bad):
    with pytest.raises(InvalidPath):
        normalize_path(bad)


def test_dot_dot_is_refused_not_resolved():
    with pytest.raises(PathNotAllowed, match=r"'\.\.'"):
        normalize_path(os.path.join("run", "..", "other", "s.pt"))
    assert normalize_path("/run/..x/s.pt") == "/run/..x/s.pt"  # only a whole component counts


def test_storage_checks_of_local_files(tmp_path):
    missing = str(tmp_path / "none.pt")
    assert not in_storage(missing) and not complete_in_storage(missing)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert in_storage(str(empty))
    assert not complete_in_storage(str(empty))  # there, but not a checkpoint
