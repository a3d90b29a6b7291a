"""Data-plane peer messages: round trips, and malformed input is always ProtocolMismatch."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptcache.errors import CheckpointNotFound, ProtocolMismatch
from ckptcache.wire import peer

PUSH = peer.PushRequest(
    namespace="default", path="/ckpt/a.pt", nbytes=1 << 20, manifest_offset=4096,
    manifest_size=512, origin="n1", manifest='{"path": "/ckpt/a.pt"}',
    skeleton_digest=(1 << 64) - 1, committed=1700000000.5, saver_uid=1000, saver_gid=100,
    saver_umask=0o022,
)  # fmt: skip
FETCH = peer.FetchRequest("default", "/ckpt/a.pt")
CORRUPT = peer.CorruptReport("default", "/ckpt/a.pt", "tensor 'w' digest mismatch")
OBJECT = peer.ObjectHead(
    namespace="default", path="/ckpt/a.pt", nbytes=1 << 20, manifest_offset=4096,
    manifest_size=512, generation=3, manifest="{}", skeleton_digest=7,
)  # fmt: skip
RELAY = peer.RelayHead("default", "/ckpt/a.pt", 1 << 20, 4096, 512)

#: (message, decoder) for every kind; JSON round trip included (the data plane sends JSON).
CASES: list[tuple[Any, Any]] = [
    (PUSH, peer.decode_request),
    (FETCH, peer.decode_request),
    (CORRUPT, peer.decode_request),
    (peer.Ack(), peer.decode_ack),
    (dataclasses.replace(PUSH, digests=(0, 7, 2**64 - 1)), peer.decode_request),
    (peer.Ack(have=(0, 2, 5)), peer.decode_ack),
    (peer.Pushed(4), peer.decode_pushed),
    (peer.Refused("CheckpointNotFound", "gone"), peer.decode_fetch_reply),
    (OBJECT, peer.decode_fetch_reply),
    (RELAY, peer.decode_fetch_reply),
]


@pytest.mark.parametrize(("message", "decode"), CASES)
def test_round_trip_through_json(message, decode):
    raw = json.loads(json.dumps(peer.encode(message)))
    assert decode(raw) == message


def test_wire_format_is_the_one_older_nodes_speak():
    assert peer.encode(FETCH) == {"op": "fetch", "namespace": "default", "path": "/ckpt/a.pt"}
    assert peer.encode(peer.Ack()) == {"ok": True}
    assert peer.encode(peer.Pushed(4)) == {"ok": True, "generation": 4}
    assert peer.encode(RELAY)["relay"] is True
    assert peer.refusal(CheckpointNotFound("no copy")) == {
        "ok": False, "error": "CheckpointNotFound", "message": "no copy",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "decode", "named"),
    [
        ({"op": "push", **{**peer.encode(PUSH), "nbytes": "9"}}, peer.decode_request, "nbytes"),
        ({**peer.encode(PUSH), "nbytes": -1}, peer.decode_request, "nbytes"),
        ({**peer.encode(PUSH), "committed": True}, peer.decode_request, "committed"),
        # Commit times become a copy's commit time in ns (a uint64 header field).
        ({**peer.encode(PUSH), "committed": -1.0}, peer.decode_request, "committed"),
        ({**peer.encode(PUSH), "committed": 1e300}, peer.decode_request, "committed"),
        ({**peer.encode(PUSH), "committed": float("nan")}, peer.decode_request, "committed"),
        ({**peer.encode(OBJECT), "committed": -5}, peer.decode_fetch_reply, "committed"),
        ({**peer.encode(RELAY), "committed": 1e19}, peer.decode_fetch_reply, "committed"),
        ({**peer.encode(CORRUPT), "generation": -1}, peer.decode_request, "generation"),
        ({**peer.encode(PUSH), "saver_uid": -2}, peer.decode_request, "saver_uid"),
        ({**peer.encode(PUSH), "digests": [2**64]}, peer.decode_request, "digests"),
        ({**peer.encode(PUSH), "digests": [-1]}, peer.decode_request, "digests"),
        ({"ok": True, "have": [2, 1]}, peer.decode_ack, "have"),
        ({**peer.encode(OBJECT), "saver_umask": 0o1000}, peer.decode_fetch_reply, "saver_umask"),
        ({"op": "fetch", "namespace": "d"}, peer.decode_request, "path"),
        ({"op": "fetch", "namespace": "d", "path": "/p", "x": 1}, peer.decode_request, "'x'"),
        ({"op": "erase", "path": "/p"}, peer.decode_request, "'erase'"),
        ({"op": 3}, peer.decode_request, "op"),
        (["op", "fetch"], peer.decode_request, "object"),
        ({"ok": "yes"}, peer.decode_ack, "'ok'"),
        ({"ok": True, "generation": 1.5}, peer.decode_pushed, "generation"),
        ({"ok": False, "error": "X"}, peer.decode_ack, "message"),
        ({**peer.encode(RELAY), "relay": "1"}, peer.decode_fetch_reply, "relay"),
        ({**peer.encode(OBJECT), "manifest_size": None}, peer.decode_fetch_reply, "manifest_size"),
    ],
)
def test_malformed_input_names_the_bad_field(raw, decode, named):
    with pytest.raises(ProtocolMismatch, match=named):
        decode(raw)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=8,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


def _check(message: Any) -> None:
    """A decoded message has every field of its declared type."""
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if f.type == "str":
            assert isinstance(value, str)
        elif f.type == "int":
            assert isinstance(value, int) and not isinstance(value, bool)
        elif f.type == "float":
            assert isinstance(value, (int, float)) and not isinstance(value, bool)


@FUZZ
@given(st.sampled_from(CASES), st.data())
def test_fuzz_mutated_fields(case, data):
    message, decode = case
    raw = peer.encode(message)
    keys = [*sorted(raw), "extra"]
    key = data.draw(st.sampled_from(keys))
    mutated = dict(raw)
    if data.draw(st.booleans()):
        mutated[key] = data.draw(json_values)
    else:
        mutated.pop(key, None)
    try:
        decoded = decode(mutated)
    except ProtocolMismatch:
        return
    _check(decoded)


@FUZZ
@given(json_values, st.sampled_from([d for _, d in CASES]))
def test_fuzz_arbitrary_json(value, decode):
    try:
        decoded = decode(value)
    except ProtocolMismatch:
        return
    _check(decoded)
