"""A backup copy of a save made before the path was deleted here is refused, compared by
stamps: the exact one, or (from a peer that sends none) the float seconds it came with,
which a mark made from the same save's stamp rounds the same way."""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest

from ckptcache.errors import CheckpointNotFound
from ckptcache.server.ingest import Ingest


def _ingest(mark: int) -> Ingest:
    state = SimpleNamespace(deleted={("ns", "p"): mark}, config=SimpleNamespace(node_id="d"),
                            lock=SimpleNamespace(held=contextlib.nullcontext))  # fmt: skip
    return Ingest(state, saves=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("exact", [True, False], ids=["stamp", "float seconds"])
def test_a_copy_of_the_save_deleted_is_refused_and_a_later_one_taken(exact):
    rng = random.Random(1)
    for _ in range(1000):
        stamp = 1_765_115_000_000_000_000 + rng.randrange(10**12)
        ingest = _ingest(stamp)  # deleted right after this save
        for saved, refused in ((stamp, True), (stamp - 1000, True), (stamp + 1000, False)):
            copy = SimpleNamespace(saved_at=saved / 1e9, content_ns=saved if exact else 0)
            if refused:
                with pytest.raises(CheckpointNotFound, match="deleted on node 'd'"):
                    ingest._refuse_deleted("ns", "p", copy)  # type: ignore[arg-type]
            else:
                ingest._refuse_deleted("ns", "p", copy)  # type: ignore[arg-type]
