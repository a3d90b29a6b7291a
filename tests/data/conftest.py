"""Fixtures of the batch-cache tests: a private cache directory (the end-to-end ones in
``tests/e2e/data/`` use it too)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture
def cache_dir() -> Iterator[str]:
    """A unique directory in /dev/shm (tmpfs, as in production), removed afterwards."""
    path = f"/dev/shm/ckptcache-test-data-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
