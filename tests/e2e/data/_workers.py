"""Processes of the multi-process batch-cache tests: ``python -m tests.e2e.data._workers ROLE JSON``.

Roles: ``trainer`` (a training loop that checkpoints its data position every step),
``holder`` (reads batches, keeps them mapped and reports, until a stop file appears; with
``fork``, also forks a child that sleeps) and
``reader`` (iterates until an error and reports it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from ckptcache.data import CachedDataLoader
from tests.data._dataset import SeqLoader, batch_digest
from tests.helpers import wait_until


def _loader(cfg: dict[str, Any], *, reading: bool = False) -> CachedDataLoader:
    def make() -> SeqLoader:
        return SeqLoader(
            cfg["n"], cfg.get("numel", 256), item_delay=cfg.get("item_delay", 0.0),
            gate=cfg.get("gate"), fail_at=cfg.get("fail_at"),
        )  # fmt: skip

    return CachedDataLoader(
        None if reading else make, cache_dir=cfg["cache_dir"], run_id=cfg["run_id"],
        prefetch=cfg.get("prefetch", 4), lookback=cfg.get("lookback", 2),
        is_loading_rank=not reading, timeout=cfg.get("timeout", 30.0),
    )  # fmt: skip


def _write_json(path: str, value: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def trainer(cfg: dict[str, Any]) -> None:
    """Consume ``epochs`` epochs, logging each batch and checkpointing the position."""
    dl = _loader(cfg)
    if cfg.get("resume"):
        with open(cfg["state"]) as f:
            dl.load_state_dict(json.load(f))
    consumed = 0
    with open(cfg["log"], "a") as log:
        while dl.epoch < cfg["epochs"]:
            for batch in dl:
                log.write(f"{dl.epoch} {dl.step - 1} {batch_digest(batch)}\n")
                log.flush()
                time.sleep(cfg.get("step_delay", 0.0))  # the training step
                _write_json(cfg["state"], dl.state_dict())  # the checkpoint
                consumed += 1
                if cfg.get("gate") and consumed == cfg["open_gate_after"]:
                    open(cfg["gate"], "w").close()
    dl.close()


def holder(cfg: dict[str, Any]) -> None:
    """Read ``hold`` batches, touch every byte, report, keep them mapped until told to stop."""
    dl = _loader(cfg, reading=not cfg["loading"])
    it = iter(dl)
    held = [next(it) for _ in range(cfg["hold"])]
    total = sum(float(b["x"].sum()) for b in held)
    child = None
    if cfg.get("fork"):  # like a DataLoader worker: a forked child that may outlive us a while
        child = os.fork()
        if child == 0:
            time.sleep(300)
            os._exit(0)
    _write_json(cfg["report"], {"pid": os.getpid(), "sum": total, "child": child})
    wait_until(lambda: os.path.exists(cfg["stop"]), 300, "the stop signal")
    dl.close(keep_cache=True)


def reader(cfg: dict[str, Any]) -> None:
    """Iterate until something is raised; report what (type names, message, batches read)."""
    dl = _loader(cfg, reading=True)
    got = 0
    try:
        for _ in dl:
            got += 1
            if got == cfg.get("ready_after"):
                open(cfg["ready"], "w").close()
            if got == cfg.get("linger_after"):
                time.sleep(cfg["linger"])  # a last training step slower than the loading rank's
    except Exception as e:
        result = {
            "types": [t.__name__ for t in type(e).__mro__],
            "message": str(e), "pid": getattr(e, "pid", None), "got": got,
        }  # fmt: skip
    else:
        result = {"types": [], "message": "", "pid": None, "got": got}
    _write_json(cfg["report"], result)


if __name__ == "__main__":
    {"trainer": trainer, "holder": holder, "reader": reader}[sys.argv[1]](json.loads(sys.argv[2]))
