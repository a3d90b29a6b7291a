"""A copy that came from storage is already persisted, on every node that holds it.

When a group loads an object, one node reads it from storage and the others receive it from
that node (or from a node that got it from there). None of them may write it back: the bytes
are the stored ones. Checked where a rewrite would show: the file's inode (a persist writes a
temp file and renames it over the path) and, on S3, the object's versions in a versioned
bucket (a persist is a new version), next to each node's persist state and timing.
"""

from __future__ import annotations

import io
import os

import torch

from tests.e2e.cluster.test_cluster import state
from tests.e2e.cluster.test_restore import load_all
from tests.helpers import assert_same, wait_until


def settled(nodes, path) -> None:
    """Every node reports the object persisted (a node that rewrites it gets there too)."""
    wait_until(lambda: all(d.info(path).persist_state == "persisted" for d in nodes),
               timeout=60)  # fmt: skip


def writes(nodes, path) -> list[str]:
    """The nodes that spent time writing ``path`` to storage (with their load tier)."""
    found = []
    for i, d in enumerate(nodes):
        status = d.info(path)
        if status.persist_seconds > 0:
            found.append(f"node{i} (loaded from {status.last_load_tier})")
    return found


def test_group_load_from_files_writes_nothing_back(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    path = root / "iter_3" / "model.pt"
    path.parent.mkdir(parents=True)
    torch.save(state(3, n=1 << 19), path)
    inode = os.stat(path).st_ino
    nodes = cluster_factory(3, "--persist-root", str(root), "--backup", "none")
    for r in load_all(nodes, path):
        assert not isinstance(r, Exception), r
        assert_same(state(3, n=1 << 19), r)
    settled(nodes, path)
    assert sorted(d.info(path).last_load_tier for d in nodes) == ["peer", "peer", "storage"]
    assert writes(nodes, path) == []
    assert os.stat(path).st_ino == inode  # never replaced


def test_group_load_from_s3_uploads_nothing(cluster_factory, s3_server, s3_bucket):
    s3 = s3_server.client()
    s3.put_bucket_versioning(  # type: ignore[attr-defined]
        Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    buf = io.BytesIO()
    torch.save(state(4, n=1 << 19), buf)
    key = "run/iter_4/model.pt"
    s3.put_object(Bucket=s3_bucket, Key=key, Body=buf.getvalue())  # type: ignore[attr-defined]
    url = f"s3://{s3_bucket}/{key}"
    nodes = cluster_factory(3, "--persist-root", f"s3://{s3_bucket}/run",
                            "--s3-endpoint-url", s3_server.endpoint, "--backup", "none")  # fmt: skip
    for r in load_all(nodes, url):
        assert not isinstance(r, Exception), r
        assert_same(state(4, n=1 << 19), r)
    settled(nodes, url)
    assert sorted(d.info(url).last_load_tier for d in nodes) == ["peer", "peer", "storage"]
    assert writes(nodes, url) == []
    versions = s3.list_object_versions(Bucket=s3_bucket, Prefix=key)  # type: ignore[attr-defined]
    assert len(versions.get("Versions", [])) == 1  # the one put above: no upload since
    assert s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []  # type: ignore[attr-defined]
