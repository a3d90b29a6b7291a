"""The ``ckptcache`` command: run the daemon, inspect and manage what it holds, run the demo.

Exit codes: 0 success, 1 operation failed (not found, corrupt, daemon gone), 2 bad usage or
configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

from ckptcache._units import format_bytes
from ckptcache.client import normalize_path
from ckptcache.errors import CheckpointNotFound, CkptCacheError, ConfigError, CorruptCheckpoint
from ckptcache.format.persisted import verify_stored
from ckptcache.hugepages import HUGE
from ckptcache.storage import backend_for

__all__ = ["main"]


def _table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        if dataclasses.is_dataclass(data) and not isinstance(data, type):
            data = dataclasses.asdict(data)
        elif isinstance(data, list):
            data = [dataclasses.asdict(d) for d in data]
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


def _client(args: argparse.Namespace) -> Any:
    from ckptcache.client import Client

    return Client(args.socket, namespace=args.namespace, fallback="raise")


def _cmd_daemon(args: argparse.Namespace) -> int:
    from ckptcache.server.config import load_config
    from ckptcache.server.daemon import run_daemon

    overrides = {
        "memory_limit": args.memory_limit,
        "shm_dir": args.shm_dir,
        "socket": args.socket,
        "node_id": args.node_id,
        "metrics_port": args.metrics_port,
        "keep": args.keep,
        "pool_segments": args.pool_segments,
        "pool_bytes": args.pool_bytes,
        "reserve_timeout": args.reserve_timeout,
        "log_level": args.log_level,
        "persist_roots": tuple(args.persist_root) if args.persist_root else None,
        "memory_only": args.memory_only,
        "persist_workers": args.persist_workers,
        "s3_endpoint_url": args.s3_endpoint_url,
        "coordinator": args.coordinator,
        "listen": args.listen,
        "backup": args.backup,
        "replicas": args.replicas,
        "host": args.host,
        "secret_file": args.secret_file,
        "cluster": args.cluster,
        "clock_offset_bound": args.clock_offset_bound,
    }
    config = load_config(args.config, {k: v for k, v in overrides.items() if v is not None})
    return run_daemon(config)


def _cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        objects = client.list(args.prefix, all_namespaces=args.all_namespaces)
    rows = [
        (o.path, o.namespace, str(o.generation), str(o.generations), format_bytes(o.size),
         ",".join(o.stages), o.persist_state, _when(o.committed))
        for o in objects
    ]  # fmt: skip
    headers = ("PATH", "NAMESPACE", "GEN", "KEPT", "SIZE", "STAGES", "PERSIST", "COMMITTED")
    _emit(args, objects, _table(rows, headers) if rows else "(no cached checkpoints)")
    return 0


def _pages(policy: str) -> str:
    if policy == "unknown":
        return "unknown (not a tmpfs, or /proc unreadable)"
    if policy not in HUGE:
        return f"4 KiB (tmpfs huge={policy}; README: Huge pages)"
    return f"2 MiB (tmpfs huge={policy})"


def _cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        st = client.daemon_status()
        objects = client.list("", all_namespaces=True)
    pairs = [
        ("node", st.node_id), ("pid", str(st.pid)), ("version", st.version),
        ("uptime", f"{st.uptime:.0f} s"), ("socket", st.socket), ("shm dir", st.shm_dir),
        ("pages", _pages(st.shm_huge_pages)),
        ("memory", f"{format_bytes(st.memory_used)} of {format_bytes(st.memory_limit)} reserved, "
                   f"{format_bytes(st.memory_stored)} stored "
                   f"({format_bytes(st.memory_free_pool)} in the free pool)"),
        ("segments", f"{st.segments} ({st.free_segments} free)"),
        ("objects", f"{st.objects} paths, {st.generations} generations, {st.pinned} pinned"),
        ("persist", f"roots: {', '.join(st.persist_roots) or 'none (memory only)'}; "
                    f"{st.persist_queue} queued"),
        ("cluster", f"{st.coordinator} nodes: {', '.join(st.cluster_nodes) or '-'}"),
        ("clocks", _clocks(st)),
    ]  # fmt: skip
    text = _table(pairs, ("DAEMON", ""))
    if objects:
        rows = [
            (o.path, str(o.generation), format_bytes(o.size), ",".join(o.stages),
             o.persist_state, _throughput(o), o.persist_error[:60] or "-")
            for o in objects
        ]  # fmt: skip
        headers = ("PATH", "GEN", "SIZE", "STAGES", "PERSIST", "THROUGHPUT", "LAST ERROR")
        text += "\n\n" + _table(rows, headers)
    _emit(
        args,
        {"daemon": dataclasses.asdict(st), "objects": [dataclasses.asdict(o) for o in objects]},
        text,
    )
    return 0


def _clocks(st: Any) -> str:
    """Each peer's clock offset (its clock minus this node's), those beyond the bound
    flagged; "-" before the first measurement or without peers."""
    bound = st.clock_offset_bound
    parts = [
        f"{c.node_id} {c.offset:+.3f} s" + (" (BEYOND BOUND)" if 0 < bound < abs(c.offset) else "")
        for c in st.clock_offsets
    ]
    return f"{'; '.join(parts)} (bound {bound:g} s)" if parts else "-"


def _throughput(o: Any) -> str:
    return f"{o.size / o.persist_seconds / 1e6:.0f} MB/s" if o.persist_seconds > 0 else "-"


def _stored(path: str) -> bool:
    try:
        return backend_for(path).exists(path)
    except (OSError, ValueError, ImportError):
        return False


def _verify_stored(path: str) -> str:
    """'' if the stored checkpoint at ``path`` checks out, else what is wrong with it."""
    try:
        verify_stored(normalize_path(path))
    except CorruptCheckpoint as e:
        return str(e)
    return ""


def _cmd_inspect(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            info = client.status(args.path)
        except CheckpointNotFound:
            if not (args.verify and _stored(normalize_path(args.path))):
                raise
            problem = _verify_stored(args.path)  # stored, but not a complete checkpoint
            _emit(args, {"storage_verify": problem}, f"storage: CORRUPT: {problem}")
            return 1
        in_memory = "local" in info.stages
        verify = client.verify(args.path) if args.verify and in_memory else None
    stored_problem = None
    on_storage = "persisted" in info.stages or "storage" in info.stages
    if args.verify and on_storage and _stored(info.path):
        stored_problem = _verify_stored(info.path)
    pairs = [
        ("path", info.path), ("namespace", info.namespace), ("generation", str(info.generation)),
        ("generations kept", str(info.generations)), ("size", format_bytes(info.size)),
        ("stages", ",".join(info.stages)), ("committed", _when(info.committed)),
        ("segment", info.segment or "-"), ("pins", str(info.pins)),
        ("digests", "recorded" if info.digests_valid else "pending"),
        ("persist", f"{info.persist_state} {_throughput(info)}"),
        ("replicas", ", ".join(info.replicas) or "-"),
        ("origin", info.origin or "saved here"),
        ("conflict", info.conflict or "-"),
        ("last error", info.persist_error or "-"),
    ]  # fmt: skip
    if verify is not None:
        pairs.append(("verify", "ok" if verify.ok else f"CORRUPT: {verify.error}"))
    if stored_problem is not None:
        pairs.append(("verify storage", f"CORRUPT: {stored_problem}" if stored_problem else "ok"))
    data: dict[str, Any] = {"object": dataclasses.asdict(info)}
    if verify is not None:
        data["verify"] = dataclasses.asdict(verify)
    if stored_problem is not None:
        data["storage_verify"] = stored_problem
    _emit(args, data, _table(pairs, ("OBJECT", "")))
    return 0 if (verify is None or verify.ok) and not stored_problem else 1


def _cmd_rm(args: argparse.Namespace) -> int:
    with _client(args) as client:
        dropped = client.delete(args.path)
    _emit(args, {"dropped": dropped}, f"dropped {dropped} generation(s) of {args.path}")
    return 0


def _cmd_prefetch(args: argparse.Namespace) -> int:
    def bar(done: int, total: int, path: str, tier: str) -> None:
        if args.json:
            return
        width = 30
        filled = width * done // total
        print(f"\r[{'#' * filled}{'-' * (width - filled)}] {done}/{total} {tier:<7} {path}",
              end="\n" if done == total else "", flush=True)  # fmt: skip

    with _client(args) as client:
        tiers = client.prefetch(args.paths, progress=bar)
    if args.json:
        print(json.dumps(dict(zip(args.paths, tiers, strict=True)), indent=2))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from ckptcache._units import parse_bytes
    from ckptcache.bench import format_measures, run_bench  # imports torch: bench only

    try:
        sizes = [parse_bytes(s) for s in args.sizes]
    except ValueError as e:
        raise ConfigError(f"--sizes: {e}") from e
    if args.repeats < 1 or any(n <= 0 for n in sizes):
        raise ConfigError("--repeats and every --sizes value must be positive")
    with _client(args) as c:
        results = run_bench(c, sizes, repeats=args.repeats, root=args.root)
    print(json.dumps(results, indent=2) if args.json else format_measures(results))
    return 0 if all(s["matched"] for s in results["sizes"]) else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from ckptcache.demo import run_demo

    return run_demo(size_mib=args.size_mib)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptcache", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def client_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--socket", help="daemon socket (default: $CKPTCACHE_SOCKET)")
        sp.add_argument("--namespace", help="job namespace (default: $CKPTCACHE_NAMESPACE)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    d = sub.add_parser("daemon", help="run the cache daemon in the foreground")
    d.add_argument("--config", help="YAML config file")
    d.add_argument("--memory-limit", help="memory budget, e.g. 8GiB")
    d.add_argument("--shm-dir", help="directory for segment files (on tmpfs)")
    d.add_argument("--socket", help="Unix socket to listen on")
    d.add_argument("--node-id", help="name of this node")
    d.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    d.add_argument("--keep", type=int, help="generations kept per path (default 2)")
    d.add_argument("--pool-segments", type=int, help="spares, sized like recent saves (default 2)")
    d.add_argument("--pool-bytes", help="bound on the spare pool (default: 1/4 of the budget)")
    d.add_argument("--reserve-timeout", type=float, help="seconds a save may wait for memory")
    d.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    d.add_argument("--persist-root", action="append", metavar="DIR_OR_URL",
                   help="persist objects saved under this root (repeatable)")  # fmt: skip
    d.add_argument("--memory-only", choices=("allow", "refuse"),
                   help="paths under no root: cache in memory only (allow) or refuse")  # fmt: skip
    d.add_argument("--persist-workers", type=int, help="concurrent persists (default 2)")
    d.add_argument("--s3-endpoint-url", help="S3 endpoint (default: the boto3 environment)")
    d.add_argument("--coordinator", help="embedded:// (default) or etcd://host:port")
    d.add_argument("--cluster", help="cluster name (namespaces coordinator keys)")
    d.add_argument("--listen", help="data-plane address ip:port for peers (port 0: any)")
    d.add_argument("--backup", help="backup placement: none, auto, or node ids (a,b)")
    d.add_argument("--replicas", type=int, help="backup copies per object (default 1)")
    d.add_argument("--host", help="host name used for placement (default: hostname)")
    d.add_argument("--secret-file", help="file with the cluster's shared secret")
    d.add_argument(
        "--clock-offset-bound", type=float, metavar="SECONDS",
        help="warn when a peer's clock is off by more (default 1; 0: never)",
    )  # fmt: skip
    d.set_defaults(fn=_cmd_daemon)

    ls = sub.add_parser("ls", help="list cached checkpoints")
    ls.add_argument("prefix", nargs="?", default="")
    ls.add_argument("--all-namespaces", action="store_true")
    client_opts(ls)
    ls.set_defaults(fn=_cmd_ls)

    st = sub.add_parser("status", help="daemon status and every cached object")
    client_opts(st)
    st.set_defaults(fn=_cmd_status)

    ins = sub.add_parser("inspect", help="details of one checkpoint")
    ins.add_argument("path")
    ins.add_argument("--verify", action="store_true", help="recompute and check digests")
    client_opts(ins)
    ins.set_defaults(fn=_cmd_inspect)

    rm = sub.add_parser("rm", help="drop a checkpoint from memory (storage is untouched)")
    rm.add_argument("path")
    client_opts(rm)
    rm.set_defaults(fn=_cmd_rm)

    pf = sub.add_parser("prefetch", help="warm this node's cache (from peers or storage)")
    pf.add_argument("paths", nargs="+")
    client_opts(pf)
    pf.set_defaults(fn=_cmd_prefetch)

    bench = sub.add_parser("bench", help="measure save/load/persist speed on this node")
    bench.add_argument("--sizes", nargs="+", default=["256MiB"], help="state sizes (256MiB)")
    bench.add_argument("--repeats", type=int, default=3, help="best of N (default 3)")
    bench.add_argument("--root", help="also persist to this directory or s3:// URL")
    client_opts(bench)
    bench.set_defaults(fn=_cmd_bench)

    demo = sub.add_parser("demo", help="start a daemon, save, kill the saver, reload, benchmark")
    demo.add_argument("--size-mib", type=int, default=512, help="state dict size (default 512)")
    demo.set_defaults(fn=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptcache`` console script."""
    args = _parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"ckptcache: {e}", file=sys.stderr)
        return 2
    except CkptCacheError as e:
        print(f"ckptcache: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
