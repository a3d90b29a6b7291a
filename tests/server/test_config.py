"""Daemon configuration layers and their errors."""

from __future__ import annotations

import pytest

from ckptcache._units import format_bytes, parse_bytes
from ckptcache.errors import ConfigError
from ckptcache.server.config import load_config


def test_sizes():
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("512M") == 512 * 10**6
    assert parse_bytes("1.5gib") == 3 << 29
    assert parse_bytes(1024) == 1024
    assert format_bytes(3 << 29) == "1.5 GiB"
    for bad in ("", "12 parsecs", "-1", True):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_layers_file_env_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "memory_limit: 2GiB\nkeep: 3\nnode_id: a\nretention:\n  - {prefix: /x/, keep: 1}\n"
    )
    c = load_config(str(cfg), environ={})
    assert (c.memory_limit, c.keep, c.node_id) == (2 << 30, 3, "a")
    assert c.keep_for("/x/y.pt") == 1 and c.keep_for("/z.pt") == 3
    c = load_config(str(cfg), {"node_id": "flag"}, environ={"CKPTCACHE_NODE_ID": "env"})
    assert c.node_id == "flag"
    assert load_config(str(cfg), environ={"CKPTCACHE_NODE_ID": "env"}).node_id == "env"


@pytest.mark.parametrize(
    "text, match",
    [
        ("memory_limit: lots\n", "memory_limit"),
        ("keep: 0\n", "keep"),
        ("colour: blue\n", "unknown config key 'colour'"),
        ("- a\n- b\n", "mapping"),
        ("retention: [{prefix: /a}]\n", "retention"),
        ("key: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_config_names_the_problem(tmp_path, text, match):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(str(cfg), environ={})


def test_missing_file_and_bad_env(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "nope.yaml"), environ={})
    with pytest.raises(ConfigError, match="from the environment"):
        load_config(None, environ={"CKPTCACHE_MEMORY_LIMIT": "huge"})


def test_spare_pool_keys():
    c = load_config(None, {"memory_limit": "8GiB"}, environ={})
    assert (c.pool_segments, c.pool_size) == (2, 2 << 30)  # a quarter of the budget
    c = load_config(None, {"pool_bytes": "1GiB", "pool_segments": 4}, environ={})
    assert (c.pool_segments, c.pool_size) == (4, 1 << 30)
    assert load_config(None, {"pool_bytes": "0"}, environ={}).pool_size == 0
    with pytest.raises(ConfigError, match="pool_segments"):
        load_config(None, {"pool_segments": -1}, environ={})
    with pytest.raises(ConfigError, match="pool_bytes"):
        load_config(None, {"pool_bytes": "lots"}, environ={})


def test_the_group_read_chooses_its_streams_unless_set():
    assert load_config(environ={}).group_read_streams == 0  # auto: chosen per read
    assert load_config(overrides={"group_read_streams": "auto"}, environ={}).group_read_streams == 0
    assert load_config(overrides={"group_read_streams": "3"}, environ={}).group_read_streams == 3


def test_every_field_has_a_validator():
    import dataclasses

    from ckptcache.server.config import VALIDATORS, DaemonConfig

    assert set(VALIDATORS) == {f.name for f in dataclasses.fields(DaemonConfig)}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("replicas", "0", "must be at least 1"),
        ("group_read_streams", -1, "must be at least 1, or auto"),
        ("persist_workers", 0, "is too small"),
        ("persist_retries", -1, "is too small"),
        ("lease_ttl", 0, "must be positive"),
        ("persist_backoff", -0.5, "must not be negative"),
        ("s3_part_size", "1MiB", "at least 5MiB"),
        ("memory_only", "sometimes", "'allow' or 'refuse'"),
        ("coordinator", "zk://x", "embedded:// or etcd://"),
        ("node_id", "", "non-empty string"),
        ("keep", "many", "invalid literal"),
        ("user_share", "0", "'fair' or a fraction"),
        ("user_share", 1.5, "'fair' or a fraction"),
    ],
)
def test_each_validator_names_the_key_and_the_source(key, value, message):
    with pytest.raises(ConfigError, match=f"invalid '{key}' from the command line: .*{message}"):
        load_config(overrides={key: value}, environ={})


def test_validators_convert_to_the_field_types():
    cfg = load_config(
        overrides={"persist_retries": "0", "reserve_timeout": "0", "listen": "", "secret": "",
                   "metrics_port": "off", "log_level": "debug", "persist_roots": "/ckpt",
                   "allowed_uids": ["7"], "retention": [{"prefix": "/a", "keep": "3"}]},
        environ={},
    )  # fmt: skip
    assert (cfg.persist_retries, cfg.reserve_timeout, cfg.listen, cfg.secret) == (0, 0.0, "", None)
    assert (cfg.metrics_port, cfg.log_level, cfg.persist_roots) == (None, "DEBUG", ("/ckpt",))
    assert cfg.allowed_uids == (7,) and cfg.retention[0].keep == 3


def test_user_share_is_fair_by_default_or_a_fraction():
    assert load_config(environ={}).user_share is None
    assert load_config(overrides={"user_share": "fair"}, environ={}).user_share is None
    assert load_config(overrides={"user_share": "0.25"}, environ={}).user_share == 0.25
