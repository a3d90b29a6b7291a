"""Hypothesis strategies the parser fuzz tests share: mutated bytes and JSON with one field
replaced (``tests/format/test_parsers.py``, ``tests/wire/test_message_fuzz.py``)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = ["FUZZ", "json_paths", "json_values", "mutations", "replace_field"]

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, and ``valid`` with bytes flipped, cut off, or spliced in."""

    def flip(data: bytes, edits: list[tuple[int, int]]) -> bytes:
        buf = bytearray(data)
        for pos, value in edits:
            buf[pos % len(buf)] = value
        return bytes(buf)

    edits = st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=8)
    return st.one_of(
        st.binary(max_size=2 * len(valid)),
        st.builds(flip, st.just(valid), edits),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=16)).map(
            lambda t: valid[: t[0]] + t[1] + valid[t[0] :]
        ),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=8,
)


def replace_field(raw: Any, path: list[str | int], value: Any) -> Any:
    """``raw`` with the entry at ``path`` (keys or indices, wrapped around) set to ``value``."""
    if not path or not isinstance(raw, (dict, list)) or not raw:
        return value
    step, rest = path[0], path[1:]
    if isinstance(raw, dict):
        key = (
            step if step in raw else sorted(raw)[(step if isinstance(step, int) else 0) % len(raw)]
        )
        return {**raw, key: replace_field(raw[key], rest, value)}
    i = step % len(raw) if isinstance(step, int) else 0
    return [*raw[:i], replace_field(raw[i], rest, value), *raw[i + 1 :]]


json_paths = st.lists(
    st.integers(0, 20) | st.sampled_from(["storages", "path", "offset"]), max_size=3
)
