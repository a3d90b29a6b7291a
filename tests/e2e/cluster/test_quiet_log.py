"""A cluster node's log at INFO holds what an operator acts on, not a line per save: the
backup copy a save makes, and the persist that follows, are at DEBUG."""

from __future__ import annotations

import torch


def test_backup_copies_and_persists_log_no_line_per_save_at_info(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    a, b = cluster_factory(2, "--persist-root", str(root))
    paths = [str(root / f"iter_{i}" / "model.pt") for i in range(5)]
    with a.client() as c:
        for p in paths:
            c.save({"w": torch.full((1024,), 1.0)}, p, durability="backup")
        for p in paths:
            c.wait(p, timeout=60)
        assert all(len(c.status(p).replicas) >= 1 for p in paths)  # the copies were made
    for d in (a, b):
        lines = d.log().splitlines()
        assert any(" INFO " in line for line in lines)  # INFO is on
        info = [line for line in lines if " INFO " in line and any(p in line for p in paths)]
        assert info == [], info
