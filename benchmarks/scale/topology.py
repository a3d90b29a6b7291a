"""Relay chain vs tree for one group's broadcast of S bytes: the model behind docs/scale.md.

    python benchmarks/scale/topology.py --size 1GiB --bandwidth 12.5e9 --hop 0.0002

A pipelined chain of n members (storage reader first, each relaying chunks of c bytes as they
land) finishes in ``S/B + (n-1) * (c/B + hop)``: one object time plus one chunk per hop. A tree
of fan-out k gives every sender k children on one uplink (B/k each) and is ``depth`` levels
deep: ``k*S/B + depth * (k*c/B + hop)``. The chain wins while ``(n-1) * c < (k-1) * S``,
roughly while the group has fewer than S/c members.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ckptcache._units import parse_bytes

CHUNK = 16 << 20  # the data plane's relay chunk (ckptcache/server/cluster/transfer.py)


def chain_seconds(n: int, size: int, bandwidth: float, hop: float, chunk: int = CHUNK) -> float:
    """A pipelined chain of ``n`` members."""
    return size / bandwidth + (n - 1) * (min(chunk, size) / bandwidth + hop)


def tree_depth(n: int, k: int) -> int:
    """Levels below the root of a complete k-ary tree holding ``n`` members."""
    depth, reach, level = 0, 1, 1
    while reach < n:
        level *= k
        reach += level
        depth += 1
    return depth


def tree_seconds(
    n: int, k: int, size: int, bandwidth: float, hop: float, chunk: int = CHUNK
) -> float:
    """A pipelined tree of fan-out ``k`` (each sender splits its uplink over k children)."""
    if n <= 1:
        return size / bandwidth
    fan = min(k, n - 1)
    return fan * size / bandwidth + tree_depth(n, k) * (fan * min(chunk, size) / bandwidth + hop)


def best(n: int, size: int, bandwidth: float, hop: float, fanouts: tuple[int, ...]) -> str:
    """The cheapest shape for a group of ``n``: "chain" or "tree k=<k>"."""
    options = {"chain": chain_seconds(n, size, bandwidth, hop)}
    for k in fanouts:
        options[f"tree k={k}"] = tree_seconds(n, k, size, bandwidth, hop)
    return min(options, key=lambda name: options[name])


def table(sizes: list[int], groups: list[int], bandwidth: float, hop: float) -> str:
    """Markdown: seconds for a chain and trees of fan-out 2 and 4, and the cheapest."""
    lines = [
        "| object | group | chain (s) | tree k=2 (s) | tree k=4 (s) | cheapest |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for size in sizes:
        for n in groups:
            c = chain_seconds(n, size, bandwidth, hop)
            t2 = tree_seconds(n, 2, size, bandwidth, hop)
            t4 = tree_seconds(n, 4, size, bandwidth, hop)
            lines.append(
                f"| {size / 2**20:.0f} MiB | {n} | {c:.3f} | {t2:.3f} | {t4:.3f} "
                f"| {best(n, size, bandwidth, hop, (2, 4))} |"
            )
    return "\n".join(lines)


def crossover(size: int, k: int, bandwidth: float, hop: float) -> int:
    """The smallest group for which a tree of fan-out ``k`` beats the chain."""
    for n in range(2, 1 << 20):
        if tree_seconds(n, k, size, bandwidth, hop) < chain_seconds(n, size, bandwidth, hop):
            return n
    return math.inf  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", nargs="+", default=["64MiB", "1GiB", "10GiB"])
    p.add_argument("--groups", type=int, nargs="+", default=[2, 8, 64, 256, 1024])
    p.add_argument("--bandwidth", type=float, default=12.5e9, help="bytes/s per link")
    p.add_argument("--hop", type=float, default=0.0002, help="seconds per hop per chunk")
    args = p.parse_args(argv)
    sizes = [parse_bytes(s) for s in args.size]
    print(table(sizes, args.groups, args.bandwidth, args.hop))
    print()
    for size in sizes:
        cross = ", ".join(f"k={k}: {crossover(size, k, args.bandwidth, args.hop)}" for k in (2, 4))
        print(f"{size / 2**20:.0f} MiB: a tree beats the chain from a group of {cross}")


if __name__ == "__main__":
    main()
