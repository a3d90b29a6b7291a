"""Wire messages decoded from random or mutated JSON either decode to a message whose fields
have their declared types or raise :class:`ProtocolMismatch`, never anything else."""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptcache.errors import ProtocolMismatch
from ckptcache.wire import messages as m
from tests.fuzzing import FUZZ, json_paths, json_values, mutations, replace_field

_MESSAGES = [getattr(m, n) for n in m.__all__ if dataclasses.is_dataclass(getattr(m, n))]


def _sample(cls: type) -> Any:
    """A valid instance of message ``cls`` (every field filled in by its type)."""
    values: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(cls).items():
        text = str(hint)
        nested = [c for c in ("ObjectInfo", "PeerClock", "KeptPlan") if c in text]
        if nested:  # a tuple of nested messages
            values[name] = (_sample(getattr(m, nested[0])),)
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            values[name] = next(iter(hint))
        elif "tuple" in text:
            values[name] = (1, 2) if "int" in text else ("a", "b")
        elif hint is bool:
            values[name] = True
        elif hint is float or "float" in text:
            values[name] = 1.5
        elif "int" in text:
            values[name] = 7
        else:
            values[name] = "x"
    return cls(**values)


@FUZZ
@given(st.sampled_from(_MESSAGES), st.data())
def test_fuzz_wire_messages(cls, data):
    valid = m.encode(_sample(cls))
    assert m.decode(cls, valid) == _sample(cls)
    text = data.draw(
        mutations(valid.encode()).map(lambda b: b.decode("utf-8", "replace"))
        | st.builds(
            lambda p, v: json.dumps(replace_field(json.loads(valid), p, v)), json_paths, json_values
        )
    )
    try:
        message = m.decode(cls, text)
    except ProtocolMismatch:
        return
    _check_types(message)


def _check_types(message: Any) -> None:
    for name, hint in typing.get_type_hints(type(message)).items():
        value = getattr(message, name)
        text = str(hint)
        if "tuple" in text:
            assert isinstance(value, tuple), (name, value)
        elif hint is float:
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
        elif hint is int or text == "int | None":
            assert value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif hint is str or text == "str | None":
            assert value is None or isinstance(value, str), (name, value)
        elif hint is bool:
            assert isinstance(value, bool), (name, value)
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            assert type(value) is hint, (name, value)


def test_deeply_nested_message_is_a_typed_error():
    with pytest.raises(ProtocolMismatch):
        m.decode(m.ReserveRequest, "[" * 100_000)


@pytest.mark.parametrize("cls", _MESSAGES, ids=lambda c: c.__name__)
def test_every_message_is_frozen_and_slotted(cls: type) -> None:
    """Each message is declared by ``messages.message``: no per-instance dict, no setting a
    field after the fact (a reply list holds one message per object)."""
    sample = _sample(cls)
    assert not hasattr(sample, "__dict__")
    field = next(iter(dataclasses.fields(cls)), None)
    if field is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sample, field.name, getattr(sample, field.name))


def test_path_requests_share_the_path_message_base() -> None:
    """Requests that name a path take namespace and path first, from one base: positional
    construction and the decoded fields are those of ``PathMessage``."""
    named = [c for c in _MESSAGES if issubclass(c, m.PathMessage) and c is not m.PathMessage]
    assert {c.__name__ for c in named} >= {
        "DeleteRequest", "OpenRequest", "ReserveRequest", "StatRequest", "WaitRequest",
    }  # fmt: skip
    for cls in named:
        first = [f.name for f in dataclasses.fields(cls)][:2]
        assert first == ["namespace", "path"], cls
    request = m.decode(m.DeleteRequest, '{"namespace": "ns", "path": "/a.pt"}')
    assert request == m.DeleteRequest("ns", "/a.pt")
