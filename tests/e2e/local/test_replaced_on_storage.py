"""A daemon without a cluster serves its persisted copy only while storage still holds it.

Another writer (a daemon on another node with no coordinator shared, a plain ``torch.save``
to the bucket) may replace the object behind this daemon's back: the next load returns the
newer object, for a file (one ``stat``) and an ``s3://`` path (one HEAD) alike."""

from __future__ import annotations

import io

import torch

from tests.helpers import assert_same


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 14, generator=g), "step": seed}


def test_an_s3_object_replaced_by_another_writer_is_read_anew(daemon_factory, s3_server,
                                                             s3_bucket):  # fmt: skip
    root = f"s3://{s3_bucket}/run"
    d = daemon_factory("--persist-root", root, "--s3-endpoint-url", s3_server.endpoint)
    path = f"{root}/last.pt"
    with d.client() as c:
        c.save(state(1), path, durability="persisted")
        assert_same(state(1), c.load(path))  # from memory
        buf = io.BytesIO()
        torch.save(state(2), buf)  # another writer replaces it on storage
        s3_server.client().put_object(Bucket=s3_bucket, Key="run/last.pt", Body=buf.getvalue())
        assert_same(state(2), c.load(path))
        assert c.status(path).stages == ("storage",) or c.status(path).generation != 1


def test_a_file_replaced_by_another_writer_is_read_anew(daemon_factory, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    d = daemon_factory("--persist-root", str(root))
    path = root / "last.pt"
    with d.client() as c:
        c.save(state(1), path, durability="persisted")
        assert_same(state(1), c.load(path))
        torch.save(state(2), str(path) + ".tmp")
        (root / "last.pt.tmp").replace(path)
        assert_same(state(2), c.load(path))
