"""Coordination at cluster scale: N simulated nodes on one real etcd (control plane real).

    python benchmarks/scale/bench.py            # N = 64, 256, 1024
    python benchmarks/scale/bench.py --quick    # N = 64 only

Each simulated node is the daemon's own etcd coordinator (see ``sim.py``) driven through the
call sequences of ``ckptcache/server/cluster/cluster.py``; storage reads, peer transfers and
persists
are modelled delays. For each N it measures: the join wave; steady state (keys, requests per
second, etcd CPU and RSS) without and with the backup monitor; save waves with groups of
R = 2, 4, 8; restart waves (time until every node has a plan, storage reads per group, relay
depth); and a save wave in which 1% of the nodes are killed mid-wave (time to takeover,
persists per group). Requests are counted at the coordinator's HTTP client and cross-checked
with etcd's own ``/metrics``. Everything runs on loopback and stops by itself; ``--json``
writes the figures (and the invariant checks) for tests and docs.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim import (
    LoadStats,
    RequestCounter,
    SaveStats,
    Scheduler,
    SimNode,
    make_groups,
    monitor,
    restore,
    save,
)

from ckptcache.cli.benchmarking import EtcdServer
from ckptcache.server.cluster.coord import CoordinatorUnavailable

WAVE_TIMEOUT = 120.0


class EtcdProbe:
    """etcd's own view: CPU seconds and RSS from /proc, request count from /metrics."""

    def __init__(self, etcd: EtcdServer):
        assert etcd.proc is not None
        self.pid = etcd.proc.pid
        self.metrics_url = f"http://127.0.0.1:{etcd.client_port}/metrics"

    def cpu_seconds(self) -> float:
        """User + system CPU time etcd has used."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        import os

        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        """Resident memory of etcd in MiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def requests(self) -> int:
        """gRPC requests etcd has handled (the JSON gateway forwards each call as one)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def keys(self, node: SimNode) -> int:
        """Keys under the cluster's prefix (one count-only range)."""
        import base64

        prefix = node.coord.prefix.encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        client = node.coord._client
        out = client.post(
            client.get_url("/kv/range"),
            json={
                "key": base64.b64encode(prefix).decode(),
                "range_end": base64.b64encode(end).decode(),
                "count_only": True,
            },
        )
        return int(out.get("count", 0))


class Window:
    """Requests, etcd CPU and simulator CPU over a span of time."""

    def __init__(self, counter: RequestCounter, probe: EtcdProbe):
        self.counter, self.probe = counter, probe
        self.t0 = time.monotonic()
        self.req0 = counter.total()
        self.etcd_req0 = probe.requests()
        self.cpu0 = probe.cpu_seconds()
        self.sim0 = _self_cpu()

    def close(self) -> dict[str, float]:
        """Figures since the window opened."""
        secs = time.monotonic() - self.t0
        return {
            "seconds": secs,
            "requests": self.counter.total() - self.req0,
            "etcd_requests": self.probe.requests() - self.etcd_req0,
            "etcd_cpu": (self.probe.cpu_seconds() - self.cpu0) / secs,
            "sim_cpu": (_self_cpu() - self.sim0) / secs,
        }


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def join_wave(nodes: list[SimNode], workers: int) -> float:
    """All daemons start at once: each takes a lease and registers."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda n: n.coord.join(n.info), nodes))
    return time.monotonic() - t0


def steady_state(nodes: list[SimNode], ctx: Context, *, with_monitor: bool) -> dict[str, float]:
    """N idle daemons holding K paths each, optionally with the backup monitor running."""
    until = time.monotonic() + ctx.window
    sched = Scheduler(ctx.workers)
    try:
        if with_monitor:
            for node in nodes:
                sched.spawn(node, monitor(node, until), delay=random.random() * 0.5)
        w = Window(ctx.counter, ctx.probe)
        time.sleep(ctx.window)  # a measurement window, not a wait for a condition
        out = w.close()
        sched.join(5.0)
    finally:
        sched.close()
    n = len(nodes)
    out["keys"] = ctx.probe.keys(nodes[0])
    out["etcd_rss_mib"] = ctx.probe.rss_mib()
    out["per_node_per_ttl"] = out["requests"] / out["seconds"] * ctx.ttl / n
    out["per_second"] = out["requests"] / out["seconds"]
    return out


def membership_scan(node: SimNode) -> dict[str, float]:
    """Cost of one full read of ``nodes/`` (what every live_nodes() refresh does) and of one
    point read (the round trip of an idle cluster, client included)."""
    times, full, rtts = [], [], []
    for _ in range(5):
        t0 = time.perf_counter()
        found = len(node.coord.live_nodes())
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        node.coord.scan("nodes/")  # what every membership read cost before reads went incremental
        full.append(time.perf_counter() - t0)
    for _ in range(21):
        t0 = time.perf_counter()
        node.coord.get("nothing/here")
        rtts.append(time.perf_counter() - t0)
    return {
        "seconds": statistics.median(times),
        "full_seconds": statistics.median(full),
        "entries": found,
        "rtt": statistics.median(rtts),
    }


def save_wave(nodes: list[SimNode], size: int, ctx: Context, kill: float = 0.0) -> dict[str, Any]:
    """Every node saves its shard; groups of ``size`` elect one representative each.

    ``kill``: fraction of nodes killed (as kill -9) once half the groups have a representative;
    at least one victim is a representative still persisting, so a takeover is measured."""
    tag = f"save-{size}-{uuid.uuid4().hex[:6]}"
    groups = make_groups(nodes, size, tag)
    stats = SaveStats()
    sched = Scheduler(ctx.workers)
    w = Window(ctx.counter, ctx.probe)
    killed: dict[str, float] = {}
    try:
        for g in groups:
            for node in g.members:
                sched.spawn(node, save(node, g, stats, ctx.persist_s, backup=False))
        if kill:
            killer = threading.Thread(target=_killer, args=(groups, stats, kill, killed, ctx))
            killer.start()
        finished = sched.join(WAVE_TIMEOUT + (3 * ctx.ttl if kill else 0))
        if kill:
            killer.join()
    finally:
        sched.close()
    win = w.close()
    firsts = [runs[0][0] for runs in stats.elections.values()]
    persists = [stats.persists[g.index] for g in groups]
    out: dict[str, Any] = {
        "groups": len(groups),
        "size": size,
        "finished": finished,
        "errors": sched.errors[:5],
        "all_reps_s": max(firsts) if len(firsts) == len(groups) else None,
        "wave_s": win["seconds"],
        "requests_per_save": win["requests"] / len(nodes),
        "etcd_cpu": win["etcd_cpu"],
        "etcd_cpu_s": win["etcd_cpu"] * win["seconds"],
        "sim_cpu": win["sim_cpu"],
        "zero_persists": sum(1 for p in persists if p == 0),
        "double_persists": sum(1 for p in persists if p > 1),
    }
    if kill:
        out["killed"] = len(killed)
        out["takeovers_s"] = _takeovers(groups, stats, killed)
        out["killed_reps"] = len(out["takeovers_s"])
    return out


def _killer(
    groups: list[Any], stats: SaveStats, frac: float, killed: dict[str, float], ctx: Context
) -> None:
    deadline = time.monotonic() + WAVE_TIMEOUT
    while sum(1 for g in groups if stats.current_rep(g)) < len(groups) / 2:
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)  # polls the simulation's own progress, not the system under test
    rng = random.Random(ctx.seed)
    nodes = [n for g in groups for n in g.members]
    victims = rng.sample(nodes, max(1, round(frac * len(nodes))))
    reps = {stats.current_rep(g) for g in groups if not stats.persists[g.index]}
    if not any(v.node_id in reps for v in victims):
        by_id = {n.node_id: n for n in nodes}
        victims[0] = by_id[rng.choice(sorted(r for r in reps if r))]
    for v in victims:
        killed[v.node_id] = time.monotonic() - stats.t0
        v.kill()


def _takeovers(groups: list[Any], stats: SaveStats, killed: dict[str, float]) -> list[float]:
    """Seconds from each killed representative's death to its successor's election."""
    out = []
    for g in groups:
        runs = stats.elections.get(g.index, [])
        for i, (_, node) in enumerate(runs):
            if node in killed and i + 1 < len(runs) and stats.persists[g.index] >= 1:
                out.append(runs[i + 1][0] - killed[node])
    return out


def restart_wave(nodes: list[SimNode], size: int, ctx: Context) -> dict[str, Any]:
    """All nodes load their shard at once after a full restart (memory empty, file persisted)."""
    groups = make_groups(nodes, size, f"load-{size}-{uuid.uuid4().hex[:6]}")
    stats = LoadStats()
    sched = Scheduler(ctx.workers)
    w = Window(ctx.counter, ctx.probe)
    try:
        for g in groups:
            for node in g.members:
                sched.spawn(node, restore(node, g, stats, ctx.transfer_s))
        finished = sched.join(WAVE_TIMEOUT)
    finally:
        sched.close()
    win = w.close()
    reads = stats.storage_reads()
    depth, fanout = stats.depth_and_fanout()
    times = [t for _, _, t in stats.plans.values()]
    rounds = list(stats.rounds.values())
    return {
        "groups": len(groups),
        "size": size,
        "finished": finished,
        "errors": sched.errors[:5],
        "planned": len(stats.plans),
        "nodes": sum(len(g.members) for g in groups),
        "all_plans_s": max(times, default=None),
        "median_plan_s": statistics.median(times) if times else None,
        "storage_reads": {
            "min": min(reads[g.index] for g in groups),
            "max": max(reads[g.index] for g in groups),
        },
        "depth": depth,
        "fanout": fanout,
        "requests_per_node": win["requests"] / len(nodes),
        "rounds_to_plan": {
            "median": statistics.median(rounds) if rounds else None,
            "max": max(rounds, default=None),
        },
        "etcd_cpu": win["etcd_cpu"],
        "etcd_cpu_s": win["etcd_cpu"] * win["seconds"],
        "sim_cpu": win["sim_cpu"],
        # What the wave needs from the coordinator when each node has its own CPU: the longest
        # chain of round trips to a plan plus one 50 ms poll, or etcd's own CPU for the wave.
        "coordinator_s": max(
            max(rounds, default=0) * ctx.rtt + 0.05, win["etcd_cpu"] * win["seconds"]
        ),
    }


class Context:
    """Settings and shared probes of one run."""

    def __init__(self, args: argparse.Namespace, etcd: EtcdServer):
        self.ttl: float = args.ttl
        self.workers: int = args.workers
        self.window: float = args.window or max(2 * args.ttl, 4.0)
        self.persist_s: float = args.persist_s
        self.transfer_s: float = args.transfer_s
        self.paths: int = args.paths
        self.seed: int = args.seed
        self.url = etcd.url
        self.counter = RequestCounter()
        self.probe = EtcdProbe(etcd)
        self.rtt = 0.0  # one idle round trip, measured per N


def run_n(n: int, ctx: Context, sizes: list[int], log: Callable[[str], None]) -> dict[str, Any]:
    """Every measurement for ``n`` nodes on a fresh cluster prefix."""
    cluster = f"scale{n}-{uuid.uuid4().hex[:6]}"
    nodes = [SimNode(i, ctx.url, cluster, ctx.ttl, ctx.counter) for i in range(n)]
    res: dict[str, Any] = {"nodes": n}
    try:
        before = ctx.counter.total()
        res["join_s"] = join_wave(nodes, ctx.workers)
        res["join_requests_per_node"] = (ctx.counter.total() - before) / n
        res["scan"] = membership_scan(nodes[0])  # before any load: the idle round trip
        ctx.rtt = res["scan"]["rtt"]
        log(f"N={n}: joined in {res['join_s']:.2f}s")
        with ThreadPoolExecutor(ctx.workers) as pool:  # K cached paths per node
            list(
                pool.map(
                    lambda node: [
                        node.coord.announce(
                            f"holders/idle{k}/d/{node.node_id}",
                            {"node": node.node_id, "committed": 0},
                        )
                        for k in range(ctx.paths)
                    ],
                    nodes,
                )
            )
        res["steady"] = steady_state(nodes, ctx, with_monitor=False)
        log(f"N={n}: steady {res['steady']}")
        res["steady_monitor"] = steady_state(nodes, ctx, with_monitor=True)
        log(f"N={n}: steady with backup monitor {res['steady_monitor']}")
        res["save"] = [save_wave(nodes, r, ctx) for r in sizes]
        log(f"N={n}: save {res['save']}")
        res["restart"] = [restart_wave(nodes, r, ctx) for r in sizes]
        log(f"N={n}: restart {res['restart']}")
        res["failures"] = save_wave(nodes, 4 if 4 in sizes else sizes[-1], ctx, kill=0.01)
        log(f"N={n}: failures {res['failures']}")
    finally:
        with ThreadPoolExecutor(ctx.workers) as pool:
            list(pool.map(lambda node: node.close(), nodes))
    return res


def check(results: list[dict[str, Any]]) -> list[str]:
    """The invariants: every wave finished, one storage read per group, one persist per group."""
    bad = []
    for res in results:
        n = res["nodes"]
        for wave in res["save"] + [res["failures"]]:
            if not wave["finished"] or wave["errors"]:
                bad.append(f"N={n} save R={wave['size']}: unfinished {wave['errors']}")
            if wave["zero_persists"] or wave["double_persists"]:
                bad.append(
                    f"N={n} save R={wave['size']}: {wave['zero_persists']} groups without "
                    f"and {wave['double_persists']} with two persists"
                )
        for wave in res["restart"]:
            if not wave["finished"] or wave["errors"] or wave["planned"] != wave["nodes"]:
                bad.append(f"N={n} restart R={wave['size']}: unfinished {wave['errors']}")
            if wave["storage_reads"] != {"min": 1, "max": 1}:
                bad.append(f"N={n} restart R={wave['size']}: storage reads {wave['storage_reads']}")
        if not res["failures"].get("killed_reps"):
            bad.append(f"N={n}: no representative was killed, no takeover measured")
    return bad


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _head(*names: str) -> list[str]:
    return [_row(*names), "|" + "---:|" * len(names)]


def tables(results: list[dict[str, Any]], ttl: float) -> str:
    """Markdown tables of every figure."""
    out = [f"### Join and steady state (lease TTL {ttl:g} s)", ""]
    out += _head(
        "N",
        "join wave (s)",
        "keys",
        "req/s",
        "req per node per TTL",
        "etcd CPU (cores)",
        "etcd RSS (MiB)",
        "with backup monitor: req/s",
        "per node per TTL",
        "sim CPU",
        "membership read, full / incremental (ms)",
        "idle round trip (ms)",
    )
    for r in results:
        s, m = r["steady"], r["steady_monitor"]
        out.append(
            _row(
                r["nodes"],
                _f(r["join_s"]),
                s["keys"],
                _f(s["per_second"], 0),
                _f(s["per_node_per_ttl"]),
                _f(s["etcd_cpu"]),
                _f(s["etcd_rss_mib"], 0),
                _f(m["per_second"], 0),
                _f(m["per_node_per_ttl"]),
                _f(m["sim_cpu"]),
                f"{_f(r['scan']['full_seconds'] * 1e3, 1)} / {_f(r['scan']['seconds'] * 1e3, 1)}",
                _f(r["scan"]["rtt"] * 1e3, 1),
            )
        )
    out += ["", "### Save wave", ""]
    out += _head(
        "N",
        "R",
        "groups",
        "all reps elected (s)",
        "wave (s)",
        "requests per save",
        "etcd CPU",
        "sim CPU",
        "groups with 0 / 2 persists",
    )
    for r in results:
        for w in r["save"]:
            out.append(
                _row(
                    r["nodes"],
                    w["size"],
                    w["groups"],
                    _f(w["all_reps_s"]),
                    _f(w["wave_s"]),
                    _f(w["requests_per_save"], 1),
                    _f(w["etcd_cpu"]),
                    _f(w["sim_cpu"]),
                    f"{w['zero_persists']} / {w['double_persists']}",
                )
            )
    out += ["", "### Restart wave", ""]
    out += _head(
        "N", "R", "every plan (s)", "median plan (s)", "storage reads per group", "relay depth",
        "fan-out", "requests per node", "round trips to plan (median / max)", "etcd CPU-s",
        "sim CPU", "coordinator time, 1 etcd core (s)",
    )  # fmt: skip
    for r in results:
        for w in r["restart"]:
            reads, rounds = w["storage_reads"], w["rounds_to_plan"]
            out.append(_row(
                r["nodes"], w["size"], _f(w["all_plans_s"]), _f(w["median_plan_s"]),
                f"{reads['min']}..{reads['max']}", w["depth"], w["fanout"],
                _f(w["requests_per_node"], 1), f"{_f(rounds['median'], 0)} / {rounds['max']}",
                _f(w["etcd_cpu_s"]), _f(w["sim_cpu"]), _f(w["coordinator_s"]),
            ))  # fmt: skip
    out += ["", "### 1% of nodes killed mid save wave", ""]
    out += _head(
        "N",
        "R",
        "killed",
        "of them representatives",
        "takeover (s): min / max",
        "groups with 0 / 2 persists",
        "wave (s)",
    )
    for r in results:
        w = r["failures"]
        t = w["takeovers_s"]
        span = f"{_f(min(t))} / {_f(max(t))}" if t else "-"
        out.append(
            _row(
                r["nodes"],
                w["size"],
                w["killed"],
                w["killed_reps"],
                span,
                f"{w['zero_persists']} / {w['double_persists']}",
                _f(w["wave_s"]),
            )
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--quick", action="store_true", help="N = 64 only")
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="group sizes R")
    p.add_argument(
        "--all-sizes",
        action="store_true",
        help="every R at N >= 1024 too (else only the last R: about 4x shorter)",
    )
    p.add_argument("--ttl", type=float, default=5.0, help="lease TTL (the daemon's default)")
    p.add_argument("--paths", type=int, default=4, help="cached paths per idle node (K)")
    p.add_argument("--workers", type=int, default=64, help="threads driving the nodes")
    p.add_argument("--window", type=float, default=0.0, help="steady-state window (s)")
    p.add_argument("--persist-s", type=float, default=1.0, help="modelled persist time")
    p.add_argument("--transfer-s", type=float, default=0.5, help="modelled read/relay time")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes = [64]
    random.seed(args.seed)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one HTTP session per node
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16384)), hard))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ckpt-scale-") as tmp:
        etcd = EtcdServer(Path(tmp) / "data").start()
        try:
            ctx = Context(args, etcd)
            results = []
            for n in args.nodes:
                sizes = args.sizes if n < 1024 or args.all_sizes else args.sizes[-1:]
                try:
                    results.append(run_n(n, ctx, sizes, log))
                except CoordinatorUnavailable as e:  # e.g. leases lapsing: the host is too slow
                    log(f"N={n}: aborted: {e}")
                    failed.append(f"N={n}: aborted: {e}")
        finally:
            etcd.stop()
    bad = failed + check(results)
    print(tables(results, args.ttl))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "violations": bad}, indent=1))
    for b in bad:
        print("VIOLATION:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
