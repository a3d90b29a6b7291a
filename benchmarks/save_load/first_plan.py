"""The planning of a first save (a plan-cache miss) alone, and its parts, in one process.

    python benchmarks/save_load/first_plan.py --rounds 7

A first save of a state of thousands of tensors stalls the trainer for its planning: the
walk (``describe``), the skeleton (``flatten``'s pickle, or the encoder of
``ckptcache.codec.skeleton`` where it applies), the tensor table, and the archive's layout
and manifest (``plan_object``, and its ``plan_archive``). This times ``PlanCache().prepare``
on a fresh cache (a miss) and each part, on ``tensor_count.py``'s ``mix`` state (75% of the
bytes in 16 MiB tensors, the rest in 64 KiB ones), best of ``--rounds``. Runs on trees
without the encoder too (its row is then left out), so a before/after comparison uses the
same script.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from ckptcache.cli.benchmarking import best_of, mixed_state
from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object
from ckptcache.codec.plan.cache import PlanCache, describe
from ckptcache.codec.table.table import encode_table
from ckptcache.format.archive import plan_archive

try:
    from ckptcache.codec.skeleton import encode_flattened
except ImportError:  # a tree before the encoder
    encode_flattened = None  # type: ignore[assignment]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--size", type=int, default=512, help="state size in MiB")
    args = p.parse_args()
    state = mixed_state(args.size << 20)
    s = describe(state)
    assert s is not None
    flat = flatten(state)
    parts: dict[str, Callable[[], Any]] = {
        "prepare (miss, whole)": lambda: PlanCache().prepare(state, "/o", "ns"),
        "describe": lambda: describe(state),
        "flatten (pickler)": lambda: flatten(state),
    }
    if encode_flattened is not None:
        parts["skeleton encoder"] = lambda: encode_flattened(
            state, s.tensors, s.storages, s.columns, s.storage_ids
        )
    parts["encode_table"] = lambda: encode_table(state, s.tensors, s.columns)
    parts["plan_object"] = lambda: plan_object(flat, "/o", "ns")
    sizes = [i.nbytes for i in flat.infos]
    parts["plan_archive (in plan_object)"] = lambda: plan_archive(flat.skeleton, sizes)
    print(f"{len(state)} tensors, load {os.getloadavg()[0]:.2f}")
    for name, fn in parts.items():
        print(f"| {name} | {best_of(args.rounds, fn) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
