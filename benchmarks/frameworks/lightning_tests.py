"""A Lightning test file run by pytest with and without the cache: what a project's own test
suite pays for checkpointing through ``CkptCacheIO``.

    python benchmarks/frameworks/lightning_tests.py --tests 20 --rounds 3

The test file is written the way Lightning's own tests are: every test fits a small model
(two epochs of two steps, a ``ModelCheckpoint`` that keeps every epoch's checkpoint) and
reloads its last checkpoint, and an autouse fixture does what the thread-leak check of
Lightning's test suite does after every test: ``stop()`` on each daemon thread the test left
behind, then a check that it ended. The same file runs twice per round, in alternation: with
Lightning's default ``TorchCheckpointIO``, and with ``CkptCacheIO`` against a daemon that
persists under pytest's base directory. Reported: the wall time of each ``pytest`` process
(interpreter start, imports and collection included), and the longest ``stop()`` the
fixture saw.

``--pythonpath DIR`` runs the tests on another checkout's ``ckptcache`` (put first on
``PYTHONPATH``), to compare two trees in one run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

from ckptcache.cli.benchmarking import running_daemon

CONFTEST = textwrap.dedent(
    '''
    import os
    import threading
    import time

    import pytest

    STOPS = os.environ["BENCH_STOPS"]


    @pytest.fixture(autouse=True)
    def thread_leak_check():
        """After each test, as Lightning's own test suite does: a daemon thread left behind
        is stopped, and must have ended when its stop() returns."""
        before = set(threading.enumerate())
        yield
        for thread in set(threading.enumerate()) - before:
            stop = getattr(thread, "stop", None)
            if thread.daemon and callable(stop):
                t0 = time.perf_counter()
                stop()
                took = time.perf_counter() - t0
                with open(STOPS, "a") as f:
                    f.write(f"{thread.name} {took:.6f}\\n")
                assert not thread.is_alive(), thread.name
    '''
)

TESTS = textwrap.dedent(
    """
    import os

    import lightning as L
    import pytest
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    CACHE = os.environ.get("BENCH_CACHE") == "1"


    class Small(L.LightningModule):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
            )

        def training_step(self, batch, _idx):
            return self.net(batch).pow(2).mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, self.net[0].in_features),
                                               batch_size=4)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)


    def plugins():
        if not CACHE:
            return []
        from ckptcache.adapters.lightning import CkptCacheIO

        return [CkptCacheIO()]


    @pytest.mark.parametrize("case", range(int(os.environ["BENCH_TESTS"])))
    def test_fit_checkpoint_and_resume(tmp_path, case):
        width = 64 + 32 * (case % 4)
        model = Small(width)
        trainer = L.Trainer(
            default_root_dir=tmp_path, max_epochs=2, limit_train_batches=2, accelerator="cpu",
            devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1)],
            plugins=plugins(),
        )
        trainer.fit(model)
        files = sorted(os.listdir(tmp_path / "ck"))
        assert files == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
        loaded = trainer.strategy.checkpoint_io.load_checkpoint(tmp_path / "ck" / files[-1])
        assert loaded["global_step"] == 4
        for k, v in model.state_dict().items():
            assert torch.equal(loaded["state_dict"][k], v)
    """
)


def run_pytest(
    suite: str, basetemp: str, tests: int, cache: bool, socket: str, pythonpath: str | None
) -> tuple[float, float, str]:
    """One ``pytest`` process over the suite: (wall seconds, longest stop() in seconds, the
    thread it was)."""
    stops = os.path.join(suite, "stops.txt")
    if os.path.exists(stops):
        os.unlink(stops)
    env = {**os.environ, "BENCH_TESTS": str(tests), "BENCH_STOPS": stops,
           "BENCH_CACHE": "1" if cache else "0", "CKPTCACHE_SOCKET": socket}  # fmt: skip
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    shutil.rmtree(basetemp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--basetemp={basetemp}", suite]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=suite, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0 or not re.search(rf"\b{tests} passed", out.stdout):
        raise RuntimeError(f"the suite failed ({'cache' if cache else 'default'}):\n"
                           + out.stdout[-4000:] + out.stderr[-4000:])  # fmt: skip
    longest, which = 0.0, "-"
    if os.path.exists(stops):
        with open(stops) as f:
            for line in f:
                name, took = line.rsplit(" ", 1)
                if float(took) > longest:
                    longest, which = float(took), name
    return wall, longest, which


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", type=int, default=20, help="tests in the file")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternated")
    parser.add_argument("--pythonpath", help="run the tests on this checkout's ckptcache")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="ckptcache-bench-lightning-")
    suite, basetemp = os.path.join(work, "suite"), os.path.join(work, "tmp")
    os.makedirs(suite)
    with open(os.path.join(suite, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    with open(os.path.join(suite, "test_lightning_checkpoints.py"), "w") as f:
        f.write(TESTS)
    results: dict[str, list[tuple[float, float, str]]] = {"default": [], "cache": []}
    try:
        with running_daemon("--persist-root", work, "--memory-limit", "2GiB") as daemon:
            for _ in range(args.rounds):
                for mode in ("default", "cache"):
                    results[mode].append(run_pytest(
                        suite, basetemp, args.tests, mode == "cache", daemon.socket,
                        args.pythonpath,
                    ))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.tests} tests, {args.rounds} rounds; wall seconds of each pytest run")
    print()
    print("| checkpoint IO | runs (s) | best (s) | longest stop() of a leftover thread |")
    print("|---|---|---:|---|")
    for mode, name in (("default", "TorchCheckpointIO (default)"), ("cache", "CkptCacheIO")):
        runs = results[mode]
        walls = ", ".join(f"{w:.1f}" for w, _, _ in runs)
        longest, which = max(((s, n) for _, s, n in runs), default=(0.0, "-"))
        stop = f"{longest * 1e3:.1f} ms ({which})" if which != "-" else "- (none left)"
        print(f"| {name} | {walls} | {min(w for w, _, _ in runs):.1f} | {stop} |")


if __name__ == "__main__":
    main()
