"""The typed states: one spelling per state, identical on the wire, checked when decoded."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ckptcache.adapters._common import is_memory_only
from ckptcache.errors import ProtocolMismatch
from ckptcache.server.memory.index import Generation
from ckptcache.wire import messages as m
from ckptcache.wire.states import ClaimRole, PersistState, Tier, WaitState


def _info(**kw: object) -> m.ObjectInfo:
    base = dict(namespace="ns", path="/p", generation=1, size=3, stages=("local",),
                committed=1.0, segment="s", pins=0, digests_valid=True)  # fmt: skip
    base.update(kw)
    return m.ObjectInfo(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("enum", [PersistState, WaitState, ClaimRole, Tier])
def test_members_are_their_strings(enum: type) -> None:
    for member in enum:
        assert member == member.value and str(member) == member.value
        assert f"{member}" == member.value and json.dumps(member) == json.dumps(member.value)


def test_defaults_agree_between_daemon_index_and_wire() -> None:
    fields = {f.name: f for f in dataclasses.fields(Generation)}
    assert fields["persist_state"].default == PersistState.MEMORY_ONLY
    assert _info().persist_state == PersistState.MEMORY_ONLY == "memory-only"


def test_wire_text_is_unchanged_and_decodes_to_enum_members() -> None:
    info = _info(persist_state=PersistState.PERSISTING)
    text = m.encode(info)
    assert json.loads(text)["persist_state"] == "persisting"
    back = m.decode(m.ObjectInfo, text)
    assert back == info and type(back.persist_state) is PersistState
    reply = m.decode(m.WaitReply, '{"generation": 2, "state": "timeout"}')
    assert reply.state is WaitState.TIMEOUT
    assert m.decode(m.PrefetchReply, m.encode(m.PrefetchReply(Tier.PEER, 1, 1))).tier is Tier.PEER


@pytest.mark.parametrize(
    ("cls", "text", "field"),
    [
        (m.WaitReply, '{"generation": 1, "state": "gone"}', "WaitReply.state"),
        (m.WaitReply, '{"generation": 1, "state": 3}', "WaitReply.state"),
        (m.PrefetchReply, '{"tier": "tape", "size": 1, "generation": 1}', "PrefetchReply.tier"),
    ],
)
def test_unknown_state_is_a_protocol_mismatch_naming_the_field(
    cls: type, text: str, field: str
) -> None:
    with pytest.raises(ProtocolMismatch, match=field):
        m.decode(cls, text)


def test_memory_only_follows_the_enum_not_guessed_spellings() -> None:
    assert is_memory_only(_info(persist_state=PersistState.MEMORY_ONLY))
    for state in PersistState:
        if state is not PersistState.MEMORY_ONLY:
            assert not is_memory_only(_info(persist_state=state))
    assert not is_memory_only(_info(stages=("local", "persisted")))
