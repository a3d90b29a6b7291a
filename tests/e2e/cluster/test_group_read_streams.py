"""A group's storage read, which peers relay as it lands, runs ``group_read_streams`` ranged GETs
at once; persists and a lone node's reads keep ``s3_max_concurrency``. By default the group
read chooses its count on the object's first bytes, up to ``s3_max_concurrency``, and then
reads on that many.

Observed at the S3 server itself (moto's, over real HTTP, in this process): every ranged GET
it serves is counted while it is in flight, and held there for a moment, as a store that
answers no faster than this lets every stream the reader opens overlap the others. The two
settings are set to different values in each test, so a reader that took its count from the
wrong one shows it.
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.e2e.cluster.test_cluster import state
from tests.e2e.cluster.test_restore import load_all
from tests.helpers import assert_same

#: How long the server holds each ranged GET before answering it.
HOLD = 0.2


class RangedGets:
    """Ranged GETs the S3 server has in flight: now, and the most at once so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.count = 0

    def enter(self) -> None:
        with self._lock:
            self.now += 1
            self.count += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self._lock:
            self.now -= 1


@pytest.fixture
def ranged_gets(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[RangedGets]:
    """Count (and hold for :data:`HOLD`) every ranged GET the test's S3 server answers."""
    from moto.s3.responses import S3Response

    gets = RangedGets()
    served = S3Response.get_object

    def counted(self: Any) -> Any:
        if not self.headers.get("range"):
            return served(self)
        gets.enter()
        try:
            time.sleep(HOLD)
            return served(self)
        finally:
            gets.leave()

    monkeypatch.setattr(S3Response, "get_object", counted)
    yield gets


def _stored(s3_server: Any, bucket: str, key: str, seed: int, n: int = 1 << 21) -> tuple[str, dict]:
    """An object written by plain ``torch.save`` (``n`` floats, about 8 MiB by default:
    several ranges)."""
    obj = state(seed, n=n)
    buf = io.BytesIO()
    torch.save(obj, buf)
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
    return f"s3://{bucket}/{key}", obj


@pytest.mark.parametrize(("streams", "others"), [(1, 4), (3, 1)])
def test_a_relayed_group_read_runs_its_own_streams(
    cluster_factory, s3_server, s3_bucket, ranged_gets, streams, others
):
    url, obj = _stored(s3_server, s3_bucket, f"run/group-{streams}.pt", seed=streams)
    nodes = cluster_factory(
        3, "--persist-root", f"s3://{s3_bucket}/run", "--s3-endpoint-url", s3_server.endpoint,
        "--backup", "none", "--group-read-streams", str(streams),
        config=f"s3_max_concurrency: {others}\n",
    )  # fmt: skip
    for r in load_all(nodes, url):
        assert not isinstance(r, Exception), r
        assert_same(obj, r)
    assert sorted(d.info(url).last_load_tier for d in nodes) == ["peer", "peer", "storage"]
    reader = next(d for d in nodes if f"reading {url} from storage" in d.log())
    assert f"reading {url} from storage ({streams} stream(s))" in reader.log()
    assert ranged_gets.count > streams  # more ranges than streams: they could all overlap
    assert ranged_gets.most == streams


def test_a_lone_node_reads_on_the_s3_concurrency(
    daemon_factory, s3_server, s3_bucket, ranged_gets, tmp_path
):
    url, obj = _stored(s3_server, s3_bucket, "run/alone.pt", seed=5)
    cfg = tmp_path / "alone.yaml"
    cfg.write_text("s3_max_concurrency: 3\ngroup_read_streams: 1\n")
    d = daemon_factory("--config", str(cfg), "--persist-root", f"s3://{s3_bucket}/run",
                       "--s3-endpoint-url", s3_server.endpoint)  # fmt: skip
    with d.client() as c:  # the daemon reads storage itself (no cluster: no relays)
        assert c.prefetch([url]) == ["storage"]
        assert_same(obj, c.load(url))
    assert f"reading {url} from storage (3 stream(s))" in d.log()
    assert ranged_gets.most == 3


def test_a_group_read_by_default_runs_the_streams_it_chose(
    cluster_factory, s3_server, s3_bucket, ranged_gets
):
    url, obj = _stored(s3_server, s3_bucket, "run/group-auto.pt", seed=7, n=1 << 23)  # 32 MiB
    nodes = cluster_factory(
        3, "--persist-root", f"s3://{s3_bucket}/run", "--s3-endpoint-url", s3_server.endpoint,
        "--backup", "none", config="s3_max_concurrency: 3\n",
    )  # fmt: skip
    for r in load_all(nodes, url):
        assert not isinstance(r, Exception), r
        assert_same(obj, r)
    assert sorted(d.info(url).last_load_tier for d in nodes) == ["peer", "peer", "storage"]
    reader = next(d for d in nodes if f"reading {url} from storage" in d.log())
    assert f"reading {url} from storage (streams: auto, at most 3)" in reader.log()
    found = re.search(rf"reading {re.escape(url)} from storage on (\d) of at most 3", reader.log())
    assert found, reader.log()
    # The probe's rounds run 1, 2, ... ranges at once, then the read runs on its choice:
    # never more at once than it chose, or than the round that showed one more was no gain.
    chosen = int(found.group(1))
    assert 1 <= chosen <= 3
    assert ranged_gets.most == min(3, chosen + 1)
