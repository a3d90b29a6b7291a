"""A fetch asks a holder of an older version as it reads: each field the holder refuses
(``ProtocolMismatch``) is dropped, from the newest on, until the holder answers. A holder's
own answer (here: no copy) ends the fallback. Driven against a stand-in holder that
refuses the fields it does not know."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import ckptcache.server.restore.fetching as fetching
from ckptcache.errors import CheckpointNotFound


def asks_of_a_holder_refusing(
    monkeypatch: pytest.MonkeyPatch, unknown: set[str], streams: int, delta: bool
) -> list[dict[str, Any]]:
    """The requests a fetch sends to a holder that refuses ``unknown`` fields."""
    asked: list[dict[str, Any]] = []
    replies: list[dict[str, Any]] = []

    def send_msg(_channel: object, message: dict[str, Any]) -> None:
        asked.append({k: v for k, v in message.items() if k not in ("op", "namespace", "path")})
        refused = sorted(set(message) & unknown)
        replies.append(
            {"ok": False, "error": "ProtocolMismatch", "message": f"unknown fields {refused}"}
            if refused else {"ok": False, "error": "CheckpointNotFound", "message": "none"}
        )  # fmt: skip

    monkeypatch.setattr(fetching, "send_msg", send_msg)
    monkeypatch.setattr(fetching, "recv_msg", lambda _channel: replies.pop(0))

    @contextlib.contextmanager
    def dial(_node: object) -> Iterator[SimpleNamespace]:
        yield SimpleNamespace(channel=object())

    fetch = fetching.Fetching.__new__(fetching.Fetching)
    fetch.streams, fetch.membership = streams, SimpleNamespace(dial=dial)
    with pytest.raises(CheckpointNotFound):  # the holder read the request and answered
        fetch._fetch(SimpleNamespace(node_id="old"), "ns", "/p", lambda: None, delta)
    return asked


@pytest.mark.parametrize(
    ("streams", "delta", "unknown", "last"),
    [
        (1, True, {"delta", "delta_stripes"}, {}),
        (4, True, {"delta", "delta_stripes"}, {"streams": 4, "relays": True}),
        (4, True, {"delta_stripes"}, {"streams": 4, "relays": True, "delta": True}),
        (4, False, {"relays"}, {"streams": 4}),
        (4, False, {"relays", "streams"}, {}),
    ],
    ids=["one-stream-no-delta", "no-delta", "no-striped-delta", "no-relays", "no-stripes"],
)
def test_a_fetch_drops_what_the_holder_refuses_until_it_answers(
    monkeypatch: pytest.MonkeyPatch, streams: int, delta: bool, unknown: set[str], last: dict
) -> None:
    asked = asks_of_a_holder_refusing(monkeypatch, unknown, streams, delta)
    assert asked[-1] == last
    assert len(asked) == len({tuple(sorted(a.items())) for a in asked})  # never asked twice
