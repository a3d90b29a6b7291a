"""The daemon's name for :mod:`ckptcache.format.archive_read`: a stored archive read into a
segment with its integrity checked as it lands (the client reads files the same way, so the
reader lives with the format)."""

from __future__ import annotations

from ckptcache.format.archive_read import BLOCK, read_archive

__all__ = ["BLOCK", "read_archive"]
