"""Incremental persists to S3 against real daemons and a real S3 endpoint (moto's server over
HTTP): ranges the previous object holds unchanged are copied inside the store, and the object
is the one a full upload gives."""

from __future__ import annotations

import io

import torch

from ckptcache.format.persisted import check_archive, list_records
from tests.e2e.local.test_incremental_persist import config, reused
from tests.helpers import assert_same, wait_until

MiB = 1 << 20


def frozen() -> dict[str, torch.Tensor]:
    """A frozen base: 8 MiB tensors (copies must be whole 5 MiB parts)."""
    g = torch.Generator().manual_seed(7)
    return {f"base.{i}": torch.randn(2 * MiB, generator=g) for i in range(4)}


def state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"base": frozen(), "adapter": torch.randn(MiB // 4, generator=g), "step": step}


def started(daemon_factory, tmp_path, s3_server, root: str, **extra):
    d = daemon_factory("--persist-root", root, "--metrics-port", "0",
                       "--s3-endpoint-url", s3_server.endpoint,
                       "--config", config(tmp_path, s3_part_size="5MiB", **extra))  # fmt: skip
    wait_until(lambda: "metrics=:" in d.log(), 30, "the daemon's ready line")
    return d


def persist(d, path: str, obj) -> None:
    with d.client() as c:
        c.save(obj, path)
        c.wait(path, timeout=60)


def stored(s3_server, bucket: str, key: str) -> bytes:
    return s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def up_to_the_save_id(data: bytes) -> bytes:
    """The object up to the id torch gives each save: every tensor's data, header and
    descriptor (the id and the digest record covering it differ between two saves)."""
    records, _ = list_records(memoryview(data))
    sid = next(r for r in records if r.name.endswith("/.data/serialization_id"))
    return data[: sid.header_offset]


def test_unchanged_ranges_are_copied_into_the_object_a_full_upload_gives(
    daemon_factory, tmp_path, s3_server, s3_bucket
):
    inc = started(daemon_factory, tmp_path, s3_server, f"s3://{s3_bucket}/a")
    full = started(daemon_factory, tmp_path, s3_server, f"s3://{s3_bucket}/b",
                   incremental_persist="false")  # fmt: skip
    for step in (1, 2):
        persist(inc, f"s3://{s3_bucket}/a/model.pt", state(step))
        persist(full, f"s3://{s3_bucket}/b/model.pt", state(step))
    # The four frozen tensors but the first (too close to the object's start for a part
    # before it) and what the part rules upload after the adapter.
    assert reused(inc) >= 16 * MiB
    assert reused(full) == 0
    new = stored(s3_server, s3_bucket, "a/model.pt")
    other = stored(s3_server, s3_bucket, "b/model.pt")
    assert len(new) == len(other) and up_to_the_save_id(new) == up_to_the_save_id(other)
    check_archive(memoryview(new), "a/model.pt", deep=True)
    assert_same(state(2), torch.load(io.BytesIO(new), weights_only=True))
    uploads = s3_server.client().list_multipart_uploads(Bucket=s3_bucket)
    assert uploads.get("Uploads", []) == []


def test_an_object_replaced_by_the_user_is_never_copied_from(
    daemon_factory, tmp_path, s3_server, s3_bucket
):
    d = started(daemon_factory, tmp_path, s3_server, f"s3://{s3_bucket}/a")
    path = f"s3://{s3_bucket}/a/model.pt"
    persist(d, path, state(1))
    s3_server.client().delete_object(Bucket=s3_bucket, Key="a/model.pt")
    persist(d, path, state(2))
    assert reused(d) == 0  # nothing to copy from: uploaded in full
    data = stored(s3_server, s3_bucket, "a/model.pt")
    check_archive(memoryview(data), "a/model.pt", deep=True)
    assert_same(state(2), torch.load(io.BytesIO(data), weights_only=True))
    persist(d, path, state(3))  # the next one copies from the object just uploaded
    assert reused(d) >= 16 * MiB
    data = stored(s3_server, s3_bucket, "a/model.pt")
    assert_same(state(3), torch.load(io.BytesIO(data), weights_only=True))


def test_a_daemon_killed_mid_upload_loses_nothing_acknowledged(
    daemon_factory, tmp_path, s3_server, s3_bucket
):
    d = started(daemon_factory, tmp_path, s3_server, f"s3://{s3_bucket}/a")
    path = f"s3://{s3_bucket}/a/model.pt"
    base = {f"base.{i}": torch.full((2 * MiB,), float(i)) for i in range(24)}  # 192 MiB

    def at(step: int) -> dict[str, object]:
        return {"base": base, "adapter": torch.full((MiB,), float(step)), "step": step}

    persist(d, path, at(1))
    with d.client() as c:
        c.save(at(2), path)  # acknowledged: in memory
        wait_until(lambda: c.status(path).persist_state in ("persisting", "persisted"),
                   30, "the persist to start", interval=0.002)  # fmt: skip
    d.restart()  # kill -9, most often while parts are copied or uploaded
    # Whatever moment the kill hit, the key holds a complete object, never a torn one.
    data = stored(s3_server, s3_bucket, "a/model.pt")
    check_archive(memoryview(data), "a/model.pt", deep=True)
    with d.client() as c:
        c.wait(path, timeout=120)
        assert_same(at(2), c.load(path))
    data = stored(s3_server, s3_bucket, "a/model.pt")
    assert_same(at(2), torch.load(io.BytesIO(data), weights_only=True))
    assert s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
