"""A daemon upgraded before its clients answers them: a reply's fields newer than the
client are left out when the client reads it; a request's unknown field is still refused
(the daemon would not do what it asks)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ckptcache.errors import ProtocolMismatch
from ckptcache.wire import messages as m


def _status() -> m.DaemonStatus:
    return m.DaemonStatus(
        node_id="n", pid=1, version="v", uptime=1.0, memory_limit=1, memory_used=0,
        memory_free_pool=0, segments=0, free_segments=0, objects=0, generations=0,
        pinned=0, reservations=0, shm_dir="/dev/shm/x", socket="/tmp/s",
        clock_offsets=(m.PeerClock("p", 0.5, 0.001, 1.0),),
    )  # fmt: skip


def test_a_reply_with_fields_newer_than_the_client_is_read_without_them():
    raw = json.loads(m.encode(_status()))
    raw["a_field_of_a_later_version"] = 7
    raw["clock_offsets"][0]["another_later_field"] = "x"
    text = json.dumps(raw)
    assert m.decode(m.DaemonStatus, text, reply=True) == _status()
    with pytest.raises(ProtocolMismatch, match="unknown fields"):
        m.decode(m.DaemonStatus, text)


def test_a_request_with_an_unknown_field_is_refused():
    raw = dataclasses.asdict(m.StatusRequest()) | {"please_also": True}
    with pytest.raises(ProtocolMismatch, match=r"unknown fields \['please_also'\]"):
        m.decode(m.StatusRequest, json.dumps(raw))
