"""What every framework adapter needs from the public client API, in one place.

Adapters name checkpoints exactly as the framework would (the path *is* the name), so the only
shared logic is: which client to talk to, how to wait for phase 2, and how to make a cached
object visible to a framework that insists on ``os.path`` checks before it loads.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ckptcache
import ckptcache.api
from ckptcache import CheckpointNotFound, DaemonUnavailable
from ckptcache.client import cache_status, normalize_path, write_from_memory
from ckptcache.wire.states import PersistState

__all__ = [
    "COMMIT_WAITS",
    "DEFAULT_COMMIT_WAITS",
    "ENV_COMMIT_WAITS",
    "cached_status",
    "cached_under",
    "check_commit_waits",
    "client_of",
    "ensure_on_disk",
    "file_is_current",
    "in_memory",
    "is_memory_only",
    "is_persisted",
    "is_url",
    "load_any",
    "report_enabled",
    "resolve_commit_waits",
    "settle",
    "wait_persisted",
    "write_from_memory",
]

log = logging.getLogger("ckptcache.adapters")

#: What an adapter's commit point may wait for before the framework writes its marker file
#: (DeepSpeed ``latest``, Megatron ``latest_checkpointed_iteration.txt``, DCP ``.metadata``):
#: ``local`` (phase 1, in this node's memory), ``persisted`` (in storage), ``files`` (a file
#: exists at every path: persisted, or written by the adapter when no persist root covers it).
COMMIT_WAITS = ("local", "persisted", "files")
#: Every adapter's default: the frameworks' own tools (DeepSpeed's ``zero_to_fp32``, DCP's
#: ``format_utils``, Lightning's directory listing, a plain ``torch.load``) read the files
#: right after the framework's save returns, so the files must be there by then.
DEFAULT_COMMIT_WAITS = "files"
#: Environment variable that sets the default ``commit_waits`` of every adapter in a process.
ENV_COMMIT_WAITS = "CKPTCACHE_COMMIT_WAITS"


def check_commit_waits(value: str) -> str:
    """Validate a ``commit_waits`` argument (one of :data:`COMMIT_WAITS`)."""
    if value not in COMMIT_WAITS:
        raise ValueError(f"commit_waits must be one of {', '.join(COMMIT_WAITS)}, not {value!r}")
    return value


def resolve_commit_waits(value: str | None) -> str:
    """``value`` if given, else ``$CKPTCACHE_COMMIT_WAITS``, else :data:`DEFAULT_COMMIT_WAITS`;
    validated (a bad environment value raises ``ValueError`` naming the variable)."""
    if value is not None:
        return check_commit_waits(value)
    env = os.environ.get(ENV_COMMIT_WAITS, "").strip()
    if not env:
        return DEFAULT_COMMIT_WAITS
    try:
        return check_commit_waits(env)
    except ValueError as e:
        raise ValueError(f"${ENV_COMMIT_WAITS}: {e}") from None


def settle(client: ckptcache.Client | None, paths: list[str], commit_waits: str) -> None:
    """Wait for what ``commit_waits`` promises about ``paths`` (see :data:`COMMIT_WAITS`).

    A save the client wrote through to storage because no daemon was reachable (its
    ``fallback="write-through"``) already is the file both promises are about: no daemon is
    needed to confirm it, so a missing daemon stops no training unless the client was asked to
    raise (``CKPTCACHE_REQUIRE=1``)."""
    if commit_waits == "local":
        return
    c = client_of(client)
    for p in paths:
        try:
            if commit_waits == "persisted":
                wait_persisted(c, p)
            else:
                ensure_on_disk(c, c.status(p))
        except DaemonUnavailable:
            if c.fallback == "raise" or not c.exists(p):
                raise


def client_of(client: ckptcache.Client | None) -> ckptcache.Client:
    """``client``, or the process's default client (the one ``ckptcache.save`` uses)."""
    return client if client is not None else ckptcache.api.default_client()


def is_persisted(info: ckptcache.ObjectStatus) -> bool:
    """Whether the newest generation is safe in storage."""
    return "persisted" in info.stages or "storage" in info.stages


def is_memory_only(info: ckptcache.ObjectStatus) -> bool:
    """Whether the daemon will never persist this object (no ``--persist-root`` covers it)."""
    return not is_persisted(info) and info.persist_state == PersistState.MEMORY_ONLY


def wait_persisted(
    client: ckptcache.Client | None, path: str, *, timeout: float | None = None
) -> None:
    """Block until ``path`` is persisted (phase 2); raises :class:`ckptcache.PersistError`
    when the daemon gave up, rather than pretending the object is durable."""
    (client or ckptcache.api.default_client()).wait(path, timeout=timeout)


#: Slack when comparing a file's mtime with a commit time: the daemon reports commit times as
#: float seconds (exact to about 0.2 us), files carry them in ns.
_STAMP_SLACK_NS = 1_000


def is_url(path: str) -> bool:
    """Whether ``path`` names an object in a remote store (``s3://...``), not a local file."""
    return "://" in path


def file_is_current(info: ckptcache.ObjectStatus) -> bool:
    """Whether the file at ``info.path`` holds the generation ``info`` describes (or a newer
    save): a file left by an earlier save of the same path does not count.

    Persisted: the daemon wrote it (it never replaces a newer file). Persist pending: not yet,
    whatever file is there is older. Memory-only: the file is current when it was written no
    earlier than the generation's commit; every file written for a generation (the daemon's
    persists, :func:`ensure_on_disk`) carries that commit time as its mtime. A URL carries no
    such stamp: current only once persisted.
    """
    if is_persisted(info):
        return is_url(info.path) or os.path.exists(info.path)
    if not is_memory_only(info) or is_url(info.path):
        return False
    try:
        mtime_ns = os.stat(info.path).st_mtime_ns
    except FileNotFoundError:
        return False
    return mtime_ns >= round(info.committed * 1e9) - _STAMP_SLACK_NS


def ensure_on_disk(client: ckptcache.Client, info: ckptcache.ObjectStatus) -> None:
    """Make the file at ``info.path`` hold its newest generation, for frameworks (and tools)
    that read files right after a save, or check ``os.path`` before they call the
    (cache-backed) engine. A file left by an earlier save of the same path is not enough.

    Pending persistence is awaited (the daemon writes the file: exactly one persisted copy);
    a memory-only object is written here, because no daemon ever will: see
    :func:`ckptcache.client.write_from_memory`. Either way the framework's later load is
    still served from memory by the adapter.
    """
    if file_is_current(info):
        return
    if not is_memory_only(info):
        wait_persisted(client, info.path)
        if is_url(info.path) or os.path.exists(info.path):
            return
    write_from_memory(client, info)


def cached_under(client: ckptcache.Client, directory: str) -> list[ckptcache.ObjectStatus]:
    """Newest cached generation of every object below ``directory`` (none without a daemon)."""
    prefix = os.path.join(normalize_path(directory), "")
    try:
        return client.list(prefix)
    except DaemonUnavailable:
        return []


def cached_status(client: ckptcache.Client, path: str) -> ckptcache.ObjectStatus | None:
    """The cache's (or storage's) view of ``path``; ``None`` when neither has it."""
    try:
        return client.status(path)
    except (CheckpointNotFound, DaemonUnavailable):
        return None


def in_memory(info: ckptcache.ObjectStatus | None) -> bool:
    """Whether ``info`` describes an object a daemon holds (not just a file in storage)."""
    return info is not None and info.stages != ("storage",)


def load_any(client: ckptcache.Client, path: str, map_location: Any = None) -> Any:
    """Load ``path`` with full unpickling, as the frameworks' own ``torch.load`` calls do."""
    return client.load(path, map_location, weights_only=False)


def report_enabled(framework: str, client: ckptcache.Client | None) -> ckptcache.CacheStatus:
    """What an adapter's ``enable()`` says: whether the cache is reachable, logged once.

    With ``CKPTCACHE_REQUIRE=1`` (or a client with ``fallback="raise"``) an unreachable daemon
    raises :class:`ckptcache.DaemonUnavailable` here, before training starts.
    """
    c = client_of(client)
    state = cache_status(c)
    if state.reachable:
        log.info("ckptcache: %s checkpoints go through the %s", framework, state.describe())
    elif c.fallback == "raise":
        raise DaemonUnavailable(f"{framework} checkpoints: {state.describe()}")
    else:
        log.warning("ckptcache: %s checkpoints: %s", framework, state.describe())
    return state
