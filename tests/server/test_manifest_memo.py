"""The commit's manifest memo: a repeat of a plan is accepted from its bytes, and only then.

Every case compares the memo with a full :meth:`Manifest.from_json` of the same bytes: the
same manifest, or the same refusal."""

from __future__ import annotations

import base64
import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from ckptcache.codec.objectio import replan
from ckptcache.codec.plan.cache import PlanCache
from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.manifest import Manifest
from ckptcache.server.manifest_memo import ManifestMemo
from ckptcache.wire import messages as m
from tests.server.conftest import NS

CAP = 1 << 30


def _state() -> dict[str, torch.Tensor]:
    return {f"layer{i}.{k}": torch.full((16 + i,), float(i)) for i in range(40) for k in "wb"}


@pytest.fixture(scope="module")
def plan():
    state = _state()
    return PlanCache().prepare(state, "/ckpt/a.pt", NS)[1]


def _both(memo: ManifestMemo, data: bytes, path: str = "/ckpt/a.pt", cap: int = CAP):
    """(memo's result, from_json's result): a manifest or the error's type and message."""

    def outcome(fn):
        try:
            return fn()
        except CorruptCheckpoint as e:
            return (type(e), str(e))

    got = outcome(lambda: memo.decode(data, path=path, namespace=NS, segment_size=cap))
    want = outcome(lambda: Manifest.from_json(data, segment_size=cap))
    return got, want


def test_a_repeat_under_another_path_and_time_is_taken_from_its_bytes(plan):
    memo = ManifestMemo()
    first, want = _both(memo, plan.manifest_bytes)
    assert first == want and (memo.hits, memo.misses) == (0, 1)
    for path, created in (("/ckpt/a.pt", 1.5), ("/ckpt/iter_0002/b.pt", 1e9 + 0.25)):
        again = replan(plan, path, NS)
        data = dataclasses.replace(again.manifest, created=created).to_json()
        got, want = _both(memo, data, path)
        assert got == want
        assert (got.path, got.created, got.storages) == (path, created, plan.manifest.storages)
    assert memo.hits == 2


@pytest.mark.parametrize(
    "created", [b"NaN", b"Infinity", b"true", b'"1"', b" 1.0", b"1.0 ", b"1e400", b"-0", b"01"]
)
def test_a_creation_time_our_encoder_would_not_write_is_decoded_in_full(plan, created):
    memo = ManifestMemo()
    memo.decode(plan.manifest_bytes, path="/ckpt/a.pt", namespace=NS, segment_size=CAP)
    text = plan.manifest_bytes
    at = text.index(b',"created":') + len(b',"created":')
    end = text.index(b',"digest_algorithm"')
    got, want = _both(memo, text[:at] + created + text[end:])
    assert got == want


def test_a_lying_record_is_refused_as_a_full_decode_refuses_it(plan):
    memo = ManifestMemo()
    memo.decode(plan.manifest_bytes, path="/ckpt/a.pt", namespace=NS, segment_size=CAP)
    raw = json.loads(plan.manifest_bytes)
    offsets = np.frombuffer(base64.b64decode(raw["storages"]["offset"]), dtype="<i8").copy()

    def with_offset_3(value: int) -> None:
        offsets[3] = value
        raw["storages"]["offset"] = base64.b64encode(offsets.tobytes()).decode()

    with_offset_3(raw["payload_offset"] + raw["payload_size"])  # past the end
    lying = json.dumps(raw, separators=(",", ":")).encode()
    got, want = _both(memo, lying)
    assert got == want and isinstance(got, tuple) and "outside the payload" in got[1]
    with_offset_3(int(offsets[2]))  # inside, not where planned
    moved = json.dumps(raw, separators=(",", ":")).encode()
    got, want = _both(memo, moved)
    assert isinstance(got, Manifest) and got == want
    assert got.storages[3].offset != plan.manifest.storages[3].offset
    assert memo.hits == 0


def test_the_segment_size_is_checked_at_every_commit(plan):
    memo = ManifestMemo()
    memo.decode(plan.manifest_bytes, path="/ckpt/a.pt", namespace=NS, segment_size=CAP)
    small = plan.manifest.payload_size // 2
    got, want = _both(memo, plan.manifest_bytes, cap=small)
    assert got == want and got[0] is CorruptCheckpoint  # type: ignore[index]
    assert "payload larger than the segment" in got[1]  # type: ignore[index]


def test_a_manifest_naming_another_path_is_decoded_with_its_own(plan):
    memo = ManifestMemo()
    memo.decode(plan.manifest_bytes, path="/ckpt/a.pt", namespace=NS, segment_size=CAP)
    got, want = _both(memo, plan.manifest_bytes, path="/ckpt/other.pt")
    assert got == want and got.path == "/ckpt/a.pt"  # the commit refuses it by that name


def test_any_changed_byte_gives_what_a_full_decode_gives(plan):
    memo = ManifestMemo()
    memo.decode(plan.manifest_bytes, path="/ckpt/a.pt", namespace=NS, segment_size=CAP)
    rng = random.Random(24)
    text = plan.manifest_bytes
    for _ in range(300):
        at = rng.randrange(len(text))
        data = text[:at] + bytes([rng.randrange(256)]) + text[at + 1 :]
        got, want = _both(memo, data)
        assert got == want, (at, data[max(0, at - 20) : at + 20])


def test_the_daemon_commits_a_repeat_from_the_memo_and_refuses_a_lying_one(make_core):
    core = make_core()
    session = core.saves.open_session(1, 0)
    cache = PlanCache()
    state = _state()

    def reserve_and_write(data_of=None):
        _, plan = cache.prepare(state, "/ckpt/a.pt", NS)
        manifest_bytes = plan.manifest_bytes if data_of is None else data_of(plan)
        request = m.ReserveRequest(NS, "/ckpt/a.pt", plan.layout.nbytes, "memory")
        reply = core.saves.reserve(session, request)
        view = core.state.arena.segments[reply.segment].view()
        try:
            offset = plan.layout.manifest_offset
            view[offset : offset + len(manifest_bytes)] = manifest_bytes
        finally:
            del view
        commit = m.CommitRequest(reply.reservation, offset, len(manifest_bytes))
        return plan, commit

    for _ in range(3):
        plan, commit = reserve_and_write()
        core.saves.commit(session, commit)
    assert (core.saves.manifests.hits, core.saves.manifests.misses) == (2, 1)
    newest = core.state.index.newest((NS, "/ckpt/a.pt"))
    assert newest.manifest == Manifest.from_json(plan.manifest_bytes)

    def lying(plan):  # the same length, one record moved past the payload
        raw = json.loads(plan.manifest_bytes)
        sizes = np.frombuffer(base64.b64decode(raw["storages"]["nbytes"]), dtype="<i8").copy()
        sizes[0] = raw["payload_size"] * 9
        raw["storages"]["nbytes"] = base64.b64encode(sizes.tobytes()).decode()
        return json.dumps(raw, separators=(",", ":")).encode()

    _, commit = reserve_and_write(lying)
    with pytest.raises(CorruptCheckpoint, match="outside the payload"):
        core.saves.commit(session, commit)
    assert core.saves.manifests.hits == 2
