"""The client's settings: the environment's defaults, the fallback's validation, the arguments
that rebuild a client, and the shared field descriptor."""

from __future__ import annotations

import pytest

from ckptcache.client._settings import FALLBACKS, Setting, Settings, discover_socket

ENV = ("CKPTCACHE_SOCKET", "CKPTCACHE_NAMESPACE", "CKPTCACHE_REQUIRE", "CKPTCACHE_ALLOW_STALE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def resolve(**given) -> Settings:
    args = {"socket_path": None, "namespace": None, "timeout": 30.0, "fallback": None,
            "daemon_uid": None, **given}  # fmt: skip
    return Settings.resolve(**args)


def test_defaults_come_from_the_environment(monkeypatch, tmp_path):
    sock = str(tmp_path / "d.sock")
    monkeypatch.setenv("CKPTCACHE_SOCKET", sock)
    monkeypatch.setenv("CKPTCACHE_NAMESPACE", "job7")
    s = resolve()
    assert (s.socket_path, s.explicit_socket, s.namespace) == (sock, False, "job7")
    assert (s.fallback, s.allow_stale, s.timeout, s.daemon_uid) == (
        "write-through", False, 30.0, None)  # fmt: skip


def test_without_environment_the_namespace_is_default_and_a_socket_is_found():
    s = resolve()
    assert s.namespace == "default"
    assert s.socket_path == discover_socket()
    assert s.socket_path.endswith("daemon.sock")


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_require_makes_the_fallback_raise(monkeypatch, value):
    monkeypatch.setenv("CKPTCACHE_REQUIRE", value)
    assert resolve().fallback == "raise"
    assert resolve(fallback="write-through").fallback == "write-through"  # an argument wins


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("on", True), ("0", False),
                                                 ("", False), ("no", False)])  # fmt: skip
def test_allow_stale_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("CKPTCACHE_ALLOW_STALE", value)
    assert resolve().allow_stale is expected
    assert resolve(allow_stale=not expected).allow_stale is (not expected)  # an argument wins


@pytest.mark.parametrize("bad", ["Raise", "write_through", "ignore"])
def test_an_unknown_fallback_is_refused(bad):
    with pytest.raises(ValueError, match="fallback must be"):
        resolve(fallback=bad)
    assert bad not in FALLBACKS


@pytest.mark.parametrize("bad", ["yes", 1, "0"])
def test_allow_stale_that_is_not_a_bool_is_refused(bad):
    with pytest.raises(TypeError, match="allow_stale must be True, False or None"):
        resolve(allow_stale=bad)


def test_given_rebuilds_the_same_settings(monkeypatch, tmp_path):
    explicit = resolve(socket_path=str(tmp_path / "a.sock"), namespace="n", fallback="raise",
                       daemon_uid=1234, allow_stale=True)  # fmt: skip
    assert explicit.explicit_socket
    assert Settings.resolve(**explicit.given()) == explicit
    # A socket found from the environment is looked up again, not pinned.
    monkeypatch.setenv("CKPTCACHE_SOCKET", str(tmp_path / "b.sock"))
    found = resolve()
    assert found.given()["socket_path"] is None


@pytest.mark.parametrize(("timeout", "wait"), [(60.0, 48.0), (2.0, 1.0), (0.5, 0.0)])
def test_server_wait_is_well_inside_the_timeout(timeout, wait):
    assert resolve(timeout=timeout).server_wait() == pytest.approx(wait)


def test_a_setting_reads_and_writes_the_shared_settings():
    class Part:
        fallback = Setting()

        def __init__(self, settings: Settings):
            self.settings = settings

    shared = resolve()
    a, b = Part(shared), Part(shared)
    a.fallback = "raise"
    assert b.fallback == "raise" and shared.fallback == "raise"
    assert isinstance(Part.fallback, Setting)
