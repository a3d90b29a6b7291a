"""The ``ckptcache`` command: run the daemon, inspect and manage what it holds, run the demo.

Exit codes: 0 success, 1 operation failed (not found, corrupt, daemon gone), 2 bad usage or
configuration, 130 interrupted, 141 the reader of the output went away (``| head``), as for a
command stopped by SIGPIPE. With ``--json`` an error is a JSON object on stdout,
``{"error": {"type", "message", "exit_code"}}``, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import zipfile
from collections.abc import Sequence
from typing import Any, NoReturn

from ckptcache._defaults import ROOT_SOCKET
from ckptcache._escape import escape
from ckptcache._units import format_bytes
from ckptcache.cli.output import emit, emit_error, plain, table, when
from ckptcache.client import in_storage, normalize_path
from ckptcache.errors import CheckpointNotFound, CkptCacheError, ConfigError, CorruptCheckpoint
from ckptcache.format.persisted import DIGESTS_MEMBER, verify_stored
from ckptcache.hugepages import HUGE
from ckptcache.storage import backend_for

__all__ = ["main"]


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
        "group_read_streams": args.group_read_streams,
        "data_plane_streams": args.data_plane_streams,
        "coordinator": args.coordinator,
        "listen": args.listen,
        "backup": args.backup,
        "replicas": args.replicas,
        "host": args.host,
        "secret_file": args.secret_file,
        "cluster": args.cluster,
        "clock_offset_bound": args.clock_offset_bound,
        "keep_on_stop": args.keep_on_stop or None,
    }
    config = load_config(args.config, {k: v for k, v in overrides.items() if v is not None})
    return run_daemon(config)


def _prefix(raw: str) -> str:
    """``ls``'s prefix resolved as ``inspect`` and ``rm`` resolve a path (relative to the
    working directory), keeping a trailing ``/`` that limits it to a directory."""
    if not raw:
        return ""
    resolved = normalize_path(raw)
    if raw.endswith("/") and not resolved.endswith("/"):
        resolved += "/"
    return resolved


def _cmd_ls(args: argparse.Namespace) -> int:
    prefix = _prefix(args.prefix)
    with _client(args) as client:
        objects = client.list(prefix, all_namespaces=args.all_namespaces)
    rows = [  # paths are any bytes: ESC or a line break would reach the terminal raw
        (escape(o.path), escape(o.namespace), str(o.generation), str(o.generations),
         format_bytes(o.size), ",".join(o.stages), o.persist_state, when(o.committed))
        for o in objects
    ]  # fmt: skip
    headers = ("PATH", "NAMESPACE", "GEN", "KEPT", "SIZE", "STAGES", "PERSIST", "COMMITTED")
    none = f"(no cached checkpoints under {prefix})" if prefix else "(no cached checkpoints)"
    emit(args.json, objects, table(rows, headers) if rows else none)
    return 0


def _pages(policy: str) -> str:
    if policy == "unknown":
        return "unknown (not a tmpfs, or /proc unreadable)"
    if policy not in HUGE:
        return f"4 KiB (tmpfs huge={policy}; docs/tuning.md, Huge pages)"
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
        ("persist", f"roots: {', '.join(st.persist_roots) or 'none'}; "
                    f"{st.persist_queue} queued; {st.digest_queue} digests queued"),
        ("cluster", f"{st.coordinator} nodes: {', '.join(st.cluster_nodes) or '-'}"),
        ("clocks", _clocks(st)),
    ]  # fmt: skip
    text = table(pairs, ("DAEMON", ""))
    if objects:
        rows = [
            (o.path, str(o.generation), format_bytes(o.size), ",".join(o.stages),
             o.persist_state, _throughput(o), o.persist_error[:60] or "-")
            for o in objects
        ]  # fmt: skip
        headers = ("PATH", "GEN", "SIZE", "STAGES", "PERSIST", "THROUGHPUT", "LAST ERROR")
        text += "\n\n" + table(rows, headers)
    emit(
        args.json,
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


def _verify_stored(path: str) -> str:
    """'' if the stored checkpoint at ``path`` checks out, else what is wrong with it."""
    try:
        verify_stored(normalize_path(path))
    except CorruptCheckpoint as e:
        return str(e)
    return ""


def _stored_facts(path: str) -> dict[str, Any]:
    """What storage says of ``path``: its size, when it was written (local files) and whether
    it carries ckptcache's digest record (local files; ``None``: not looked at)."""
    facts: dict[str, Any] = {"path": path, "size": backend_for(path).size(path),
                             "modified": 0.0, "digest_record": None}  # fmt: skip
    if "://" not in path:
        facts["modified"] = os.path.getmtime(path)
        try:
            with zipfile.ZipFile(path) as z:
                facts["digest_record"] = any(n.endswith(f"/{DIGESTS_MEMBER}") for n in z.namelist())
        except (OSError, zipfile.BadZipFile):
            facts["digest_record"] = False  # not a zip: --verify says what it is
    return facts


def _inspect_stored(args: argparse.Namespace, path: str) -> int:
    """``inspect`` of a checkpoint that only storage holds: what the stored file is, never
    generation or digest fields that describe a cached copy."""
    facts = _stored_facts(path)
    record = facts["digest_record"]
    pairs = [
        ("path", path),
        ("where", "on storage only (not in this node's memory)"),
        ("size", format_bytes(facts["size"])),
        ("modified", when(facts["modified"])),
        ("digest record", "-" if record is None else "yes" if record else
                          "no (zip CRC-32 only: not written by ckptcache)"),
    ]  # fmt: skip
    data: dict[str, Any] = {"stored": facts}
    problem = None
    if args.verify:
        problem = _verify_stored(path)
        pairs.append(("verify storage", f"CORRUPT: {problem}" if problem else "ok"))
        data["storage_verify"] = problem
    emit(args.json, data, table(pairs, ("STORED", "")))
    return 1 if problem else 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = normalize_path(args.path)
    with _client(args) as client:
        try:
            info = client.status(path)
        except CheckpointNotFound:
            if not (args.verify and in_storage(path)):
                raise
            problem = _verify_stored(path)  # stored, but not a complete checkpoint
            emit(args.json, {"storage_verify": problem}, f"storage: CORRUPT: {problem}")
            return 1
        if "local" not in info.stages:  # the daemon knows no generation: storage answered
            return _inspect_stored(args, path)
        verify = client.verify(path) if args.verify else None
    stored_problem = None
    if args.verify and "persisted" in info.stages and in_storage(info.path):
        stored_problem = _verify_stored(info.path)
    pairs = [
        ("path", info.path), ("namespace", info.namespace),
        ("where", "in this node's memory" + (" and on storage" if "persisted" in info.stages
                                             else "")),
        ("generation", str(info.generation)),
        ("generations kept", str(info.generations)), ("size", format_bytes(info.size)),
        ("stages", ",".join(info.stages)), ("committed", when(info.committed)),
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
    emit(args.json, data, table(pairs, ("OBJECT", "")))
    return 0 if (verify is None or verify.ok) and not stored_problem else 1


def _cmd_rm(args: argparse.Namespace) -> int:
    path = normalize_path(args.path)
    with _client(args) as client:
        dropped = client.delete(path)
    emit(args.json, {"path": path, "dropped": dropped},
         f"dropped {dropped} generation(s) of {path}")  # fmt: skip
    return 0


def _cmd_prefetch(args: argparse.Namespace) -> int:
    drawn = not args.json and sys.stdout.isatty()  # a bar on a terminal; a table elsewhere

    def bar(done: int, total: int, path: str, tier: str) -> None:
        width = 30
        filled = width * done // total
        print(f"\r[{'#' * filled}{'-' * (width - filled)}] {done}/{total} {tier:<7} {path}",
              end="\n" if done == total else "", flush=True)  # fmt: skip

    paths = [normalize_path(p) for p in args.paths]
    with _client(args) as client:
        tiers = client.prefetch(paths, progress=bar if drawn else None)
    if args.json:
        print(json.dumps(dict(zip(paths, tiers, strict=True)), indent=2))
    elif not drawn:
        print(table(list(zip(paths, tiers, strict=True)), ("PATH", "TIER")))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from ckptcache._units import parse_bytes

    # The arguments first: a typo is reported at once, not after torch's import (seconds).
    try:
        sizes = [parse_bytes(s) for s in args.sizes]
    except ValueError as e:
        raise ConfigError(f"--sizes: {e}") from e
    if args.repeats < 1 or any(n <= 0 for n in sizes):
        raise ConfigError("--repeats and every --sizes value must be positive")
    from ckptcache.cli.bench import format_measures, run_bench  # imports torch: bench only

    with _client(args) as c:
        # The bar only where someone watches it: in a file or a pipe it is noise.
        results = run_bench(c, sizes, repeats=args.repeats, root=args.root,
                            progress=sys.stderr.isatty())  # fmt: skip
    print(json.dumps(results, indent=2) if args.json else format_measures(results))
    return 0 if all(s["matched"] for s in results["sizes"]) else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from ckptcache.cli.demo import run_demo

    return run_demo(size_mib=args.size_mib)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as JSON when the command line asks for ``--json``, and
    a command's unknown arguments reported with that command's usage."""

    def __init__(self, *args: Any, json_errors: bool = False, command: bool = False, **kw: Any):
        if "description" in kw:
            kw["description"] = plain(kw["description"])
        super().__init__(*args, **kw)
        self.json_errors = json_errors
        self.command = command

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self.command:
            # A command's parser gets every argument after the command's name: what it does
            # not know is its to report, with its usage (argparse would hand the arguments to
            # the top-level parser, whose usage lists the commands instead).
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def add_argument(self, *args: Any, **kw: Any) -> Any:
        if kw.get("help"):
            kw["help"] = plain(kw["help"])
        return super().add_argument(*args, **kw)

    def error(self, message: str) -> NoReturn:
        if not self.json_errors:
            super().error(message)
        emit_error(True, f"{self.prog}: {message}", 2)
        sys.exit(2)


#: The daemon command's plain options (each overrides the config key of its name): flag,
#: type, help.
_DAEMON_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("--config", str, "YAML config file"),
    ("--memory-limit", str, "memory budget, e.g. 8GiB"),
    ("--shm-dir", str, "directory for segment files (on tmpfs)"),
    ("--socket", str, "Unix socket to listen on"),
    ("--node-id", str, "name of this node"),
    ("--metrics-port", int, "serve Prometheus metrics on this port"),
    ("--keep", int, "generations kept per path (default 2)"),
    ("--pool-segments", int, "spares, sized like recent saves (default 2)"),
    ("--pool-bytes", str, "bound on the spare pool (default: 1/4 of the budget)"),
    ("--reserve-timeout", float, "seconds a save may wait for memory"),
    ("--log-level", str, "DEBUG, INFO, WARNING or ERROR"),
    ("--persist-workers", int, "concurrent persists (default 2)"),
    ("--s3-endpoint-url", str, "S3 endpoint (default: the boto3 environment)"),
    ("--group-read-streams", str, "ranged GETs at once of a relayed group read (default auto)"),
    ("--data-plane-streams", str, "connections one push or fetch is split across (default auto)"),
    ("--coordinator", str, "embedded:// (default) or etcd://host:port"),
    ("--cluster", str, "cluster name (namespaces coordinator keys)"),
    ("--listen", str, "data-plane address ip:port for peers (port 0: any)"),
    ("--backup", str, "backup placement: none, auto, or node ids (a,b)"),
    ("--replicas", int, "backup copies per object (default 1)"),
    ("--host", str, "host name used for placement (default: hostname)"),
    ("--secret-file", str, "file with the cluster's shared secret"),
)


#: Where a command finds its daemon (:func:`ckptcache._defaults.candidate_sockets`).
_SOCKET_HELP = (
    "daemon socket (default: $CKPTCACHE_SOCKET; else the first that exists of your own "
    "daemon's, $XDG_RUNTIME_DIR/ckptcache/daemon.sock or, without XDG_RUNTIME_DIR, "
    f"/tmp/ckptcache-UID/daemon.sock, and root's, {ROOT_SOCKET}; as root, root's)"
)


def _parser(json_errors: bool = False) -> argparse.ArgumentParser:
    p = _Parser(prog="ckptcache", description=__doc__.split("\n\n")[0], json_errors=json_errors,
                epilog=plain(__doc__.split("\n\n", 1)[1]))  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add = functools.partial(sub.add_parser, json_errors=json_errors, command=True)

    def client_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--socket", help=_SOCKET_HELP)
        sp.add_argument(
            "--namespace", help="job namespace (default: $CKPTCACHE_NAMESPACE, else default)"
        )
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    d = add("daemon", help="run the cache daemon in the foreground")
    for flag, kind, help_ in _DAEMON_OPTIONS:
        d.add_argument(flag, type=kind, help=help_)
    d.add_argument(
        "--persist-root",
        help="persist objects saved under this root (repeatable)",
        action="append",
        metavar="DIR_OR_URL",
    )
    d.add_argument(
        "--memory-only",
        help="paths under no root: cache in memory only (allow) or refuse",
        choices=("allow", "refuse"),
    )
    d.add_argument(
        "--clock-offset-bound",
        help="warn when a peer's clock is off by more (default 1; 0: never)",
        type=float,
        metavar="SECONDS",
    )
    d.add_argument(
        "--keep-on-stop",
        action="store_true",
        help="keep persisted checkpoints in memory at a clean stop, for the next start "
        "(default: their memory is given back; unpersisted ones always stay)",
    )
    d.set_defaults(fn=_cmd_daemon)

    ls = add("ls", help="list cached checkpoints")
    ls.add_argument(
        "prefix",
        nargs="?",
        default="",
        help="only paths that start with it, resolved like inspect's path (relative to the "
        "working directory; a trailing / keeps to that directory); default: every path",
    )
    ls.add_argument(
        "--all-namespaces",
        action="store_true",
        help="every job's checkpoints, not only those of --namespace",
    )
    client_opts(ls)
    ls.set_defaults(fn=_cmd_ls)

    st = add("status", help="daemon status and every cached object")
    client_opts(st)
    st.set_defaults(fn=_cmd_status)

    ins = add("inspect", help="details of one checkpoint")
    ins.add_argument("path", help="the checkpoint's path (relative to the working directory)")
    ins.add_argument("--verify", action="store_true", help="recompute and check digests")
    client_opts(ins)
    ins.set_defaults(fn=_cmd_inspect)

    rm = add("rm", help="drop a checkpoint from memory (storage is untouched)")
    rm.add_argument("path", help="the checkpoint's path (relative to the working directory)")
    client_opts(rm)
    rm.set_defaults(fn=_cmd_rm)

    pf = add("prefetch", help="warm this node's cache (from peers or storage)")
    pf.add_argument(
        "paths", nargs="+", help="checkpoints to bring into this node's memory (paths or URLs)"
    )
    client_opts(pf)
    pf.set_defaults(fn=_cmd_prefetch)

    bench = add("bench", help="measure save/load/persist speed on this node")
    bench.add_argument("--sizes", nargs="+", default=["256MiB"], help="state sizes (256MiB)")
    bench.add_argument("--repeats", type=int, default=3, help="best of N (default 3)")
    bench.add_argument("--root", help="also persist to this directory or s3:// URL")
    client_opts(bench)
    bench.set_defaults(fn=_cmd_bench)

    demo = add(
        "demo", help="start a daemon, save, kill the saver, see it persisted, reload, benchmark"
    )
    demo.add_argument("--size-mib", type=int, default=512, help="state dict size (default 512)")
    demo.set_defaults(fn=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptcache`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    args = _parser(json_errors=as_json).parse_args(argv)
    try:
        code = int(args.fn(args))
        sys.stdout.flush()  # here, so that a reader gone away is seen below
        return code
    except BrokenPipeError:
        # The reader left (``| head``): not an error of ours. Python flushes stdout again at
        # exit, which would raise once more, so stdout now points at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except KeyboardInterrupt:
        return 130
    except ConfigError as e:
        emit_error(as_json, e, 2)
        return 2
    except (CkptCacheError, OSError) as e:
        # OSError: the failures a user can act on (a missing file, no permission, a full
        # disk), said in one line like the errors of our own.
        emit_error(as_json, e, 1)
        return 1
