"""The manifest's base64 decoder (``ckptcache/format/b64.py``, the ``_b64`` extension): it
accepts exactly what ``base64.b64decode(text, validate=True)`` accepts, decodes it to the
same bytes, and refuses the rest with the same error and message."""

from __future__ import annotations

import base64
import os
import platform

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptcache.format import b64

_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _reference(text: str | bytes) -> bytes | tuple[type, str]:
    """binascii's bytes, or its error and message where it refuses ``text`` (``ValueError``
    for a str that is not ASCII, ``binascii.Error``, one, for the rest)."""
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:
        return type(e), str(e)


def _ours(text: str | bytes) -> bytes | tuple[type, str]:
    """:func:`b64.decode`'s answer, after a check of the extension's own: what it accepts,
    binascii decodes the same way; a canonical encoding (as ``b64encode`` writes it) it
    accepts (its refusals fall back to binascii, which would hide a wrong one). binascii
    also takes padding past a whole group (``AAAA==``): the extension leaves that to it."""
    expected = _reference(text)
    if b64._NATIVE is not None:
        try:
            assert b64._NATIVE(text) == expected
        except ValueError:
            raw = text.encode("ascii", "replace") if isinstance(text, str) else text
            assert type(expected) is not bytes or base64.b64encode(expected) != raw
    try:
        return b64.decode(text)
    except ValueError as e:
        return type(e), str(e)


def test_the_extension_is_built_on_x86_64_linux():
    """As the copy extension: a build that lost it would silently decode at a quarter of the
    speed."""
    if platform.machine() != "x86_64":
        pytest.skip("the extension is required on x86-64 Linux only")
    assert b64.IMPLEMENTATION == "native"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 57, 58, 59, 60, 1000, 100_003])
def test_any_bytes_come_back(n):
    raw = os.urandom(n)
    for text in (base64.b64encode(raw), base64.b64encode(raw).decode("ascii")):
        assert _ours(text) == raw


@pytest.mark.parametrize(
    "text",
    [
        "=", "==", "===", "====", "A", "AB", "ABC", "AB=", "A===", "AB=C", "AB==AB==", "ABCD=",
        "AB==\n", " ABC", "AB C", "ABC-", "ABC_", "ABCé", "ABC\x00", "QUJD\n", "QUI=QUI=",
        "QUJDRA==", "QUJDRA=", "QUJDRB==", "QUJDREU=", "QUJDREV=",
    ],
)  # fmt: skip
def test_what_binascii_refuses_is_refused_in_its_words(text):
    """Bad characters, padding anywhere but the end, a length not a multiple of four; and
    padding bits that are not zero (``QUJDRB==``) accepted, as binascii does."""
    assert _ours(text) == _reference(text)
    assert _ours(text.encode("utf-8")) == _reference(text.encode("utf-8"))


@settings(max_examples=600, deadline=None)
@given(st.text(alphabet=_ALPHABET + "=" + " \n-_.é\x00", max_size=40))
def test_the_same_as_binascii_on_any_text(text):
    assert _ours(text) == _reference(text)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 400), st.sampled_from("=A/ -\n"))
def test_the_same_as_binascii_on_a_changed_encoding(raw, where, char):
    """A real encoding with one character replaced, inserted or cut."""
    text = base64.b64encode(raw).decode("ascii")
    i = where % (len(text) + 1)
    for changed in (text[:i] + char + text[i + 1 :], text[:i] + char + text[i:], text[:i]):
        assert _ours(changed) == _reference(changed)


def test_without_the_extension_binascii_decodes(monkeypatch):
    monkeypatch.setattr(b64, "_NATIVE", None)
    raw = os.urandom(999)
    assert b64.decode(base64.b64encode(raw).decode("ascii")) == raw
    assert _ours("AB=C") == _reference("AB=C")
