"""A node saving a path again while its backup node still holds the previous save.

The backup copy is announced by the backup node; the persist election used to count it as
that node's own content, so the re-save looked like a digest disagreement between two nodes
(``status(path).conflict``) and, the older content being persisted already, was written
beside the path as ``<path>.conflict-<digest>``: ``durability="persisted"`` returned while the
path on storage still held the older checkpoint. Found by the cluster lab
(``tests/e2e/cluster/test_lab_faults.py::test_one_way_partition_the_other_way``).
"""

from __future__ import annotations

import torch

from tests.e2e.cluster.test_cluster import state
from tests.helpers import assert_same, wait_until


def test_resave_replaces_the_path_although_the_backup_holds_the_old_save(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    path = root / "iter" / "model.pt"
    a, b = cluster_factory(2, "--persist-root", str(root))
    with a.client() as ca:
        ca.save(state(1), path, durability="backup")
        wait_until(lambda: ca.status(path).persist_state == "persisted", timeout=60)
        assert b.info(path).generation >= 1  # b holds the old save as a's backup copy
        ca.save(state(2), path, durability="persisted")  # seconds after the first
        assert not ca.status(path).conflict
    assert_same(state(2), torch.load(path, weights_only=True))
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]  # no .conflict-*
