"""A group's storage read relayed to the other members in stripes (``data_plane_streams``)
between real daemons: every member holds the same bytes (digests equal), through a chain of
striped relays, and a relaying member killed with SIGKILL mid-relay leaves the others the
whole object (from storage or another member) or a typed error, never a mixture.

The storage read is slowed at the S3 server (every ranged GET held for a moment, see
``test_group_read_streams.py``), so that the others join while it is still in flight."""

from __future__ import annotations

import threading
from typing import Any

import torch
import xxhash

from ckptcache.errors import CkptCacheError
from tests.e2e.cluster.test_group_read_streams import _stored, ranged_gets  # noqa: F401
from tests.e2e.cluster.test_restore import load_all
from tests.helpers import assert_same, wait_until

CONFIG = "data_plane_streams: 4\ns3_max_concurrency: 4\n"
N = 24 << 20  # float32 elements: 96 MiB, four relay stripes' worth
RELAYING = "on 4 relay stripes)"  # the relaying node's line
RECEIVING = "on 4 relay stripes"  # also the receiving node's


def _group(cluster_factory: Any, s3_server: Any, s3_bucket: str) -> list[Any]:
    return cluster_factory(
        3, "--persist-root", f"s3://{s3_bucket}/run", "--s3-endpoint-url", s3_server.endpoint,
        "--backup", "none", "--log-level", "DEBUG", config=CONFIG,
    )  # fmt: skip


def _digests(obj: dict[str, Any]) -> dict[str, int]:
    """Each tensor's xxh3 (the digest the manifests carry)."""
    return {k: xxhash.xxh3_64_intdigest(v.numpy().tobytes()) for k, v in obj.items()
            if isinstance(v, torch.Tensor)}  # fmt: skip


def _verified(node: Any, url: str) -> bool:
    """The daemon's copy against its own digest table."""
    with node.client() as c:
        return c.verify(url).ok


def test_a_striped_relay_delivers_the_same_bytes(
    cluster_factory,
    s3_server,
    s3_bucket,
    ranged_gets,  # noqa: F811
):
    url, obj = _stored(s3_server, s3_bucket, "run/relayed.pt", seed=11, n=N)
    nodes = _group(cluster_factory, s3_server, s3_bucket)
    results = load_all(nodes, url)
    for r in results:
        assert not isinstance(r, Exception), r
        assert_same(obj, r)
    assert all(_digests(r) == _digests(obj) for r in results)
    # One member read storage; the two others took it from a peer while it arrived.
    assert [d.info(url).last_load_tier for d in nodes].count("peer") == 2
    relays = [d for d in nodes if RELAYING in d.log()]
    assert relays, "no member relayed the read in stripes"
    received = [ln for d in nodes for ln in d.log().splitlines() if "receiving relayed" in ln]
    assert received and all(RECEIVING in ln for ln in received)
    assert all(_verified(d, url) for d in nodes)


def test_a_relaying_member_killed_mid_relay(
    cluster_factory,
    s3_server,
    s3_bucket,
    ranged_gets,  # noqa: F811
):
    """SIGKILL of the member relaying the read in stripes while they are under way: every other
    member ends with the whole object or a typed error, and its next load is whole."""
    url, obj = _stored(s3_server, s3_bucket, "run/killed.pt", seed=12, n=N)
    nodes = _group(cluster_factory, s3_server, s3_bucket)
    box: dict[str, list[Any]] = {}
    loads = threading.Thread(target=lambda: box.update(r=load_all(nodes, url)))
    loads.start()
    relaying = wait_until(lambda: next((d for d in nodes if RELAYING in d.log()), None),
                          timeout=60, interval=0.002, what="a striped relay")  # fmt: skip
    relaying.kill()
    loads.join(150)
    assert not loads.is_alive()
    survivors = [d for d in nodes if d is not relaying]
    for d, r in zip(nodes, box["r"], strict=True):
        if d is relaying:
            continue
        if isinstance(r, Exception):
            assert isinstance(r, CkptCacheError), repr(r)
        else:
            assert_same(obj, r)
    for d in survivors:  # whole either way, checked against its digests
        with d.client() as c:
            got = c.load(url, verify=True)
        assert_same(obj, got)
        assert _digests(got) == _digests(obj) and _verified(d, url)
