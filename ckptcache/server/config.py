"""Daemon configuration in layers: defaults < YAML file < environment < command-line flags.

Every layer is validated into one frozen :class:`DaemonConfig`; anything wrong raises
:class:`ckptcache.errors.ConfigError` naming the key and the layer it came from.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ckptcache._defaults import ENV_SOCKET, default_shm_dir, default_socket
from ckptcache._units import parse_bytes
from ckptcache.errors import ConfigError
from ckptcache.storage.base import StorageOptions

__all__ = ["VALIDATORS", "DaemonConfig", "RetentionRule", "load_config"]

#: Environment variables that override config keys (handy for tests and containers).
ENV_OVERRIDES = {
    "CKPTCACHE_MEMORY_LIMIT": "memory_limit",
    "CKPTCACHE_SHM_DIR": "shm_dir",
    ENV_SOCKET: "socket",
    "CKPTCACHE_NODE_ID": "node_id",
    "CKPTCACHE_METRICS_PORT": "metrics_port",
    "CKPTCACHE_S3_ENDPOINT_URL": "s3_endpoint_url",
}


@dataclass(frozen=True)
class RetentionRule:
    """Keep the ``keep`` newest generations of paths starting with ``prefix``."""

    prefix: str
    keep: int


_HOSTNAME = socket.gethostname


def _default_memory_limit(shm_dir: str = "/dev/shm") -> int:
    """Half the machine's memory, and never more than 90% of the file system of ``shm_dir``
    (its nearest existing ancestor: the daemon creates the directory later)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    existing = os.path.abspath(shm_dir)
    while not os.path.exists(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    try:
        st = os.statvfs(existing)
        shm = st.f_frsize * st.f_blocks
    except OSError:
        shm = total
    return int(min(total * 0.5, shm * 0.9))


@dataclass(frozen=True)
class DaemonConfig:
    """Everything the daemon needs; see docs/daemon.md, Configuration, for each key."""

    node_id: str = field(default_factory=socket.gethostname)
    shm_dir: str = field(default_factory=default_shm_dir)
    socket: str = field(default_factory=default_socket)
    memory_limit: int = field(default_factory=_default_memory_limit)
    #: How long a save may wait for memory before it fails (and the client writes through).
    reserve_timeout: float = 10.0
    #: Generations kept per path unless a retention rule says otherwise.
    keep: int = 2
    #: Spare pre-faulted segments kept ready for first saves of new paths, sized like the
    #: last saves (none before a save), and the bound on their total size (None: a quarter
    #: of memory_limit; 0 disables the pool).
    pool_segments: int = 2
    pool_bytes: int | None = None
    retention: tuple[RetentionRule, ...] = ()
    #: Prometheus endpoint port; None disables it, 0 picks a free port.
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    #: Users (besides the daemon's own and root) whose processes may use the socket.
    allowed_uids: tuple[int, ...] = ()
    #: With admitted users: the part of memory_limit each user may hold (root and the
    #: daemon's uid count as one user). None ("fair"): an equal share among the users holding
    #: memory now, the saver included; a fraction (0, 1]: that part, whoever else is active.
    user_share: float | None = None
    log_level: str = "INFO"
    #: Storage roots (directories or URL prefixes) the daemon persists under.
    persist_roots: tuple[str, ...] = ()
    #: "refuse" (default): a save under no root fails at once; "allow": it is cached in
    #: memory only (never persisted). A save can also ask for memory only itself
    #: (``durability="memory"``).
    memory_only: str = "refuse"
    persist_workers: int = 2
    #: Retries after the first failed attempt, with exponential backoff between them.
    persist_retries: int = 5
    persist_backoff: float = 0.5
    persist_backoff_max: float = 30.0
    #: Copy the records that did not change since the previous persist of a local path from
    #: that file (``copy_file_range``: a reflink where the file system shares blocks), each
    #: checked as read back; off: every persist writes the whole file (docs/persistence.md).
    incremental_persist: bool = True
    #: A backup push offers its digests when the receiver may hold some of its storages, and
    #: sends only the ones it does not (see ``server/cluster/delta.py``).
    incremental_push: bool = True
    #: An older generation's pages equal to a newer one's are read from the newer one's
    #: memory, not held twice (``server/memory/sharing.py``).
    share_pages: bool = True
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_part_size: int = 64 << 20
    s3_max_concurrency: int = 4
    #: Ranged GETs at once of a group's storage read, the one that peers relay as it lands
    #: (``s3_max_concurrency`` stays the count for persists and a lone node's reads). Relays
    #: trail the read by about the ranges in flight, and one connection gets a fraction of a
    #: real object store's bandwidth. 0 ("auto", the default): chosen at the start of each
    #: read, up to ``s3_max_concurrency``, by whether one more range raises the rate
    #: (``format/prefix_read.py``); docs/restore.md says when to set a count.
    group_read_streams: int = 0
    #: embedded:// (single node, the default) or etcd://host:port
    coordinator: str = "embedded://"
    cluster: str = "default"
    job: str = "default"
    #: Data-plane address "ip:port" (port 0 picks one); empty: no data plane.
    listen: str = ""
    #: Host name used for placement (backups never go to the same host).
    host: str = field(default_factory=lambda: _HOSTNAME())
    #: "none", "auto" (ring over live nodes) or a comma-separated list of node ids.
    backup: str = "none"
    replicas: int = 1
    #: Shared secret of the cluster (or a file holding it); required with a data plane.
    secret: str | None = None
    secret_file: str | None = None
    lease_ttl: float = 5.0
    #: Seconds between sweeps dropping cached objects whose directory was removed (0: off).
    orphan_sweep: float = 30.0
    #: Keep every segment at a clean stop (SIGTERM/SIGINT). By default the persisted ones are
    #: unlinked, their memory given back (storage holds them); unpersisted ones always stay.
    keep_on_stop: bool = False
    #: Optional TLS on the data plane: this node's certificate and key, and the cluster CA.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    #: Seconds an accepted data-plane connection has to finish the handshake.
    handshake_timeout: float = 5.0
    #: Seconds a peer may leave data-plane bytes (or keep-alive probes) unacknowledged before
    #: it counts as dead and the transfer fails over (``TCP_USER_TIMEOUT``). Shorter on a
    #: fast, quiet fabric finds a partitioned peer sooner; too short drops live peers whose
    #: link stalls for longer (a congested switch, a paused VM).
    dead_peer_timeout: float = 10.0
    #: Connections (and so cores, one per end each) one transfer between nodes may be split
    #: across: a backup push, a peer fetch or a relay, at either end. 0 ("auto", the
    #: default): half the cores this daemon may run on, at most 8; 1: one connection. The
    #: daemon's share of the node's cores for moving bytes (docs/scale.md).
    data_plane_streams: int = 0
    #: Data-plane connections served at once (also capped to half the open-file limit).
    max_peer_connections: int = 256
    #: Of those, connections still in the handshake; the oldest is dropped to admit a new one.
    max_unauthenticated_peers: int = 32
    #: Seconds a peer's clock may be off this node's before a warning names it (0: never).
    clock_offset_bound: float = 1.0
    #: Seconds between two measurements of a peer's clock offset (0: not measured).
    clock_check_interval: float = 60.0

    def storage_options(self) -> StorageOptions:
        """The storage settings of this configuration (what every backend is built with)."""
        return StorageOptions(
            s3_endpoint_url=self.s3_endpoint_url,
            s3_region=self.s3_region,
            s3_part_size=self.s3_part_size,
            s3_max_concurrency=self.s3_max_concurrency,
            s3_connections=max(self.s3_max_concurrency, self.group_read_streams),
        )

    def cluster_secret(self) -> bytes | None:
        """The shared secret, from ``secret``, ``secret_file`` or $CKPTCACHE_CLUSTER_SECRET."""
        if self.secret:
            return self.secret.encode()
        if self.secret_file:
            try:
                with open(self.secret_file, "rb") as f:
                    return f.read().strip()
            except OSError as e:
                raise ConfigError(f"cannot read secret_file {self.secret_file!r}: {e}") from e
        env = os.environ.get("CKPTCACHE_CLUSTER_SECRET")
        return env.encode() if env else None

    @property
    def pool_size(self) -> int:
        """Bytes of the spare pool: ``pool_bytes``, by default a quarter of the budget."""
        return self.memory_limit // 4 if self.pool_bytes is None else self.pool_bytes

    def keep_for(self, path: str) -> int:
        """Generations to keep for ``path``: the longest matching rule wins."""
        best: RetentionRule | None = None
        for rule in self.retention:
            if path.startswith(rule.prefix) and (
                best is None or len(rule.prefix) > len(best.prefix)
            ):
                best = rule
        return best.keep if best else self.keep

    @property
    def segments_dir(self) -> str:
        """Directory of the segment files."""
        return os.path.join(self.shm_dir, "segments")


_FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}


#: Checks one raw value (YAML, environment text or flag) and returns it in the field's type;
#: raises ``ValueError``/``TypeError`` with what is wrong (the key is named by the caller).
Validator = Callable[[Any], Any]


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return value


def _optional_text(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


def _listen(value: Any) -> str:
    return "" if value in ("", None) else _text(value)


def _coordinator(value: Any) -> str:
    if not str(value).startswith(("embedded", "etcd://")):
        raise ValueError("must be embedded:// or etcd://host:port")
    return _text(value)


def _count(minimum: int, message: str = "is too small") -> Validator:
    def check(value: Any) -> int:
        count = int(value)
        if count < minimum:
            raise ValueError(message)
        return count

    return check


def _streams(value: Any) -> int:
    if str(value).strip().lower() == "auto":
        return 0  # chosen per read
    return _count(0, "must be at least 1, or auto (0)")(value)


def _seconds(*, zero_ok: bool) -> Validator:
    def check(value: Any) -> float:
        number = float(value)
        if number < 0 or (number == 0 and not zero_ok):
            raise ValueError("must not be negative" if zero_ok else "must be positive")
        return number

    return check


def _dead_peer(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):  # the kernel's TCP_USER_TIMEOUT takes whole milliseconds
        raise ValueError("must be a finite number of seconds")
    if number < 1:  # TCP keep-alive counts whole seconds; less drops live peers on a hiccup
        raise ValueError("must be at least 1 second")
    return number


def _memory_limit(value: Any) -> int:
    size = parse_bytes(value)
    if size <= 0:
        raise ValueError("must be positive")
    return size


def _optional_bytes(value: Any) -> int | None:
    return None if value in (None, "") else parse_bytes(value)


def _s3_part_size(value: Any) -> int:
    size = parse_bytes(value)
    if size < 5 << 20:
        raise ValueError("must be at least 5MiB (the S3 minimum part size)")
    return size


def _persist_roots(value: Any) -> tuple[str, ...]:
    roots = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(r, str) and r for r in roots):
        raise ValueError("must be a list of directories or URL prefixes")
    return tuple(roots)


def _memory_only(value: Any) -> str:
    if value not in ("allow", "refuse"):
        raise ValueError("must be 'allow' or 'refuse'")
    return str(value)


def _metrics_port(value: Any) -> int | None:
    return None if value in (None, "", "none", "off") else int(value)


def _retention(value: Any) -> tuple[RetentionRule, ...]:
    if not isinstance(value, list):
        raise ValueError("must be a list of {prefix, keep}")
    rules = []
    for item in value:
        if not isinstance(item, Mapping) or set(item) != {"prefix", "keep"}:
            raise ValueError("each rule needs exactly 'prefix' and 'keep'")
        if int(item["keep"]) < 1:
            raise ValueError("keep must be at least 1")
        rules.append(RetentionRule(str(item["prefix"]), int(item["keep"])))
    return tuple(rules)


def _user_share(value: Any) -> float | None:
    if value in (None, "fair"):
        return None
    share = float(value)
    if not 0 < share <= 1:
        raise ValueError("must be 'fair' or a fraction of memory_limit in (0, 1]")
    return share


def _allowed_uids(value: Any) -> tuple[int, ...]:
    return tuple(int(u) for u in value)


def _log_level(value: Any) -> str:
    level = str(value).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
    return level


#: One validator per :class:`DaemonConfig` field (a unit test checks none is missing).
VALIDATORS: dict[str, Validator] = {
    "node_id": _text,
    "shm_dir": _text,
    "socket": _text,
    "memory_limit": _memory_limit,
    "reserve_timeout": _seconds(zero_ok=True),
    "keep": _count(1, "must be at least 1"),
    "retention": _retention,
    "metrics_port": _metrics_port,
    "metrics_addr": _text,
    "allowed_uids": _allowed_uids,
    "user_share": _user_share,
    "log_level": _log_level,
    "persist_roots": _persist_roots,
    "memory_only": _memory_only,
    "persist_workers": _count(1),
    "s3_endpoint_url": _optional_text,
    "s3_region": _optional_text,
    "s3_part_size": _s3_part_size,
    "s3_max_concurrency": _count(1),
    "group_read_streams": _streams,
    "persist_retries": _count(0),
    "persist_backoff": _seconds(zero_ok=True),
    "persist_backoff_max": _seconds(zero_ok=True),
    "incremental_persist": _flag,
    "incremental_push": _flag,
    "share_pages": _flag,
    "coordinator": _coordinator,
    "cluster": _text,
    "job": _text,
    "listen": _listen,
    "host": _text,
    "backup": _text,
    "replicas": _count(1, "must be at least 1"),
    "secret": _optional_text,
    "secret_file": _optional_text,
    "lease_ttl": _seconds(zero_ok=False),
    "orphan_sweep": _seconds(zero_ok=True),
    "keep_on_stop": _flag,
    "tls_cert": _optional_text,
    "tls_key": _optional_text,
    "tls_ca": _optional_text,
    "handshake_timeout": _seconds(zero_ok=False),
    "dead_peer_timeout": _dead_peer,
    "data_plane_streams": _streams,
    "max_peer_connections": _count(1),
    "max_unauthenticated_peers": _count(1),
    "clock_offset_bound": _seconds(zero_ok=True),
    "clock_check_interval": _seconds(zero_ok=True),
    "pool_bytes": _optional_bytes,
    "pool_segments": _count(0, "must not be negative"),
}


def _coerce(key: str, value: Any, source: str) -> Any:
    try:
        return VALIDATORS[key](value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid {key!r} from {source}: {e} (got {value!r})") from e


def _apply(values: dict[str, Any], layer: Mapping[str, Any], source: str) -> None:
    for key, value in layer.items():
        if key not in _FIELDS:
            raise ConfigError(
                f"unknown config key {key!r} in {source}; known keys: {', '.join(sorted(_FIELDS))}"
            )
        if value is not None:
            values[key] = _coerce(key, value, source)


def load_config(
    path: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DaemonConfig:
    """Build the config from a YAML file, the environment and explicit overrides (flags)."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from e
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path!r} must hold a mapping of keys to values")
        _apply(values, data, f"config file {path!r}")
    env = os.environ if environ is None else environ
    _apply(values, {k: env[v] for v, k in ENV_OVERRIDES.items() if v in env}, "the environment")
    _apply(values, overrides or {}, "the command line")
    if "memory_limit" not in values and "shm_dir" in values:  # a tmpfs of its own, maybe
        values["memory_limit"] = _default_memory_limit(values["shm_dir"])
    return DaemonConfig(**values)
