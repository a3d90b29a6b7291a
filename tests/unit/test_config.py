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
