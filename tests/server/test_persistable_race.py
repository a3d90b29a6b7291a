"""``check_persistable`` against a directory made while it looks (the persist of the path's
previous save making its directories): a race that refused a save of a demo with
``ParentNotADirectory`` although every parent was a directory."""

from __future__ import annotations

import os

import pytest

from ckptcache.errors import ParentNotADirectory
from ckptcache.server.persist import lineage


def test_a_directory_made_between_the_two_tests_is_no_refusal(tmp_path, monkeypatch):
    head = tmp_path / "run" / "iter_0000100"
    real_isdir = os.path.isdir
    made = []

    def isdir_then_made(path):
        answer = real_isdir(path)
        if os.fspath(path) == str(head) and not made:
            made.append(path)
            os.makedirs(head)  # made right after the first answer, "not a directory"
        return answer

    monkeypatch.setattr(lineage.os.path, "isdir", isdir_then_made)
    lineage.check_persistable(str(head / "mp_rank_00" / "model.pt"))
    assert made and real_isdir(head)


def test_a_file_as_a_parent_is_still_refused(tmp_path):
    (tmp_path / "run").write_text("a file")
    with pytest.raises(ParentNotADirectory, match="is not a directory"):
        lineage.check_persistable(str(tmp_path / "run" / "iter_1" / "model.pt"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ParentNotADirectory, match="dangling"):
        lineage.check_persistable(str(tmp_path / "dangling" / "model.pt"))
