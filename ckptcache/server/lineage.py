"""What the user deleted stays deleted: the directories a save found, and whether they remain.

At save time the daemon records the *anchor* of a local path: its deepest ancestor directory
that existed then. Every directory between the anchor and the file was missing at save time,
so a persist may create those, and only those (``server.safe_write`` walks the path below
its root and raises :class:`DirectoryRemoved` for a missing level the anchor covers). If the
anchor itself is gone later, the user removed the directory the checkpoint was saved into
(``shutil.rmtree`` of a checkpoint directory, an adapter's rotation): the generation is
treated as deleted by the user. It is never persisted (that would resurrect the directory)
and its memory becomes evictable.

URLs (S3 and other object stores) have no directories; their anchor is empty and never gone.
"""

from __future__ import annotations

import os

__all__ = ["DirectoryRemoved", "anchor_of", "is_orphaned", "removed_reason"]


class DirectoryRemoved(OSError):
    """A directory that existed when the checkpoint was saved has been removed since."""


def _is_url(path: str) -> bool:
    return "://" in path


def anchor_of(path: str) -> str:
    """The deepest existing ancestor directory of ``path`` ("" for a URL)."""
    if _is_url(path):
        return ""
    head = os.path.dirname(path)
    while head and not os.path.isdir(head):
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    return head or "/"


def is_orphaned(anchor: str) -> bool:
    """Whether the directory a checkpoint was saved into has been removed since."""
    return bool(anchor) and not os.path.isdir(anchor)


def removed_reason(anchor: str) -> str:
    """The status text of a generation whose directory the user removed."""
    return (
        f"directory {anchor} existed at save time and was removed since: treated as deleted "
        "by the user, not persisted"
    )
