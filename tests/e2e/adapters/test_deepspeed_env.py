"""``CKPTCACHE_DEEPSPEED=1``: DeepSpeed through the cache with no line of ckptcache code.

The package is really installed (``pip install`` of this source tree, regular and editable)
into a fresh virtual environment whose only addition is a path to the installed frameworks;
its processes start with no ``PYTHONPATH``, so what runs is what ``pip`` put in
``site-packages``, startup hook included.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckptcache
from ckptcache.adapters import _startup
from tests.e2e.adapters.conftest import SCRIPTS, daemon_env
from tests.helpers import REPO

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.timeout(900)

PTH = "ckptcache-startup.pth"
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", PTH, "ckptcache")
TAG = "global_step3"


@dataclass(frozen=True)
class Venv:
    python: Path
    site: Path


def _pip(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-deps", "--no-build-isolation", "--no-index", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv with ckptcache installed by ``pip install`` (the frameworks it needs are
    reached through a path entry to the environment running the tests)."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], check=True)
    python = root / "env" / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=_env(),
    )  # fmt: skip
    site = Path(where.stdout.strip())
    (site / "zz_frameworks.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _pip("--target", str(site), str(_copy_sources(root / "src")))
    return Venv(python, site)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CKPTCACHE_DEEPSPEED")}
    return {**env, **extra}


def _run(venv: Venv, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv.python), "-c", code], env=_env(**env), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip


LOADED = (
    "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
    "('ckptcache', 'torch', 'deepspeed')))"
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("", None), ("0", None), ("Off", None), ("1", ""), (" TRUE ", ""),
     ("files", "files"), ("persisted", "persisted"), ("local", "local")],
)  # fmt: skip
def test_setting_values(value, expected):
    environ = {} if value is None else {_startup.DEEPSPEED_ENV: value}
    assert _startup.deepspeed_setting(environ) == expected


def test_bad_setting_is_a_config_error():
    with pytest.raises(ckptcache.ConfigError, match=r"\$CKPTCACHE_DEEPSPEED='sometimes'"):
        _startup.deepspeed_setting({_startup.DEEPSPEED_ENV: "sometimes"})


def test_after_import_hook_runs_once_after_the_module_ran(tmp_path, monkeypatch):
    (tmp_path / "ckptcache_probe_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    finder = _startup._AfterImport("ckptcache_probe_mod", lambda mod: seen.append(mod.VALUE))
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    import ckptcache_probe_mod  # type: ignore[import-not-found]

    assert seen == [42] and ckptcache_probe_mod.VALUE == 42
    assert finder not in sys.meta_path  # one-shot
    importlib.reload(ckptcache_probe_mod)  # a reload works, and is the plain module's
    assert seen == [42] and ckptcache_probe_mod.VALUE == 42
    monkeypatch.delitem(sys.modules, "ckptcache_probe_mod")


def test_after_import_hook_outlives_a_find_spec_probe(tmp_path, monkeypatch):
    """A lookup without an import (``importlib.util.find_spec``, as HF transformers and
    accelerate probe for DeepSpeed) leaves the hook in place for the import that follows."""
    (tmp_path / "ckptcache_probe_mod2.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    finder = _startup._AfterImport("ckptcache_probe_mod2", lambda mod: seen.append(mod.VALUE))
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    assert importlib.util.find_spec("ckptcache_probe_mod2") is not None
    assert importlib.util.find_spec("ckptcache_probe_mod2") is not None
    assert seen == [] and finder in sys.meta_path
    import ckptcache_probe_mod2  # type: ignore[import-not-found]

    assert seen == [7] and ckptcache_probe_mod2.VALUE == 7
    assert finder not in sys.meta_path  # done once the module ran
    monkeypatch.delitem(sys.modules, "ckptcache_probe_mod2")


def test_pip_install_puts_the_hook_in_site_packages(venv):
    assert (venv.site / PTH).read_text() == (REPO / PTH).read_text()
    record = next(venv.site.glob("ckptcache-*.dist-info")) / "RECORD"
    assert any(line.split(",")[0] == PTH for line in record.read_text().splitlines())


def test_hook_costs_nothing_when_unset(venv):
    proc = _run(venv, LOADED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    # Set but DeepSpeed never imported: the small hook module only, no torch.
    proc = _run(venv, LOADED + "; import ckptcache; print(ckptcache.__file__)",
                CKPTCACHE_DEEPSPEED="1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    loaded, where = proc.stdout.splitlines()
    assert eval(loaded) == ["ckptcache", "ckptcache._version", "ckptcache.adapters",
                            "ckptcache.adapters._deepspeed_env", "ckptcache.adapters._startup",
                            "ckptcache.errors"]  # fmt: skip
    assert where.startswith(str(venv.site))  # the installed copy, not the source tree
    # Off values install nothing either.
    proc = _run(venv, "import sys; print(any(type(f).__name__ == '_AfterImport' "
                "for f in sys.meta_path))", CKPTCACHE_DEEPSPEED="0")  # fmt: skip
    assert proc.stdout.strip() == "False", proc.stderr


def test_bad_value_is_a_config_error_at_import_deepspeed(venv):
    proc = _run(venv, "import deepspeed", CKPTCACHE_DEEPSPEED="maybe")
    assert proc.returncode != 0
    assert "ckptcache.errors.ConfigError: $CKPTCACHE_DEEPSPEED='maybe'" in proc.stderr
    assert "'files'" in proc.stderr  # names what it accepts


ENGINE = (
    "import deepspeed.runtime.engine as e; c = e.create_checkpoint_engine(config_params=None, "
    "groups=None, zero_stage=0, has_moe_layers=False, optimize_dp_state=False); "
    "print(type(c).__name__, getattr(c, 'commit_waits', '-'))"
)


def test_value_picks_commit_waits_and_reachability_is_checked_at_the_first_engine(venv, tmp_path):
    nowhere = str(tmp_path / "no-daemon.sock")
    proc = _run(venv, ENGINE, CKPTCACHE_DEEPSPEED="files", CKPTCACHE_SOCKET=nowhere)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "CkptCacheCheckpointEngine files"
    assert "DeepSpeed checkpoints: cache NOT reachable" in proc.stderr  # said, not hidden
    proc = _run(venv, ENGINE, CKPTCACHE_DEEPSPEED="on", CKPTCACHE_SOCKET=nowhere,
                CKPTCACHE_REQUIRE="1")  # fmt: skip
    assert proc.returncode != 0
    assert "ckptcache.errors.DaemonUnavailable: DeepSpeed checkpoints" in proc.stderr
    proc = _run(venv, ENGINE, CKPTCACHE_DEEPSPEED="off")
    assert proc.stdout.splitlines()[-1] == "TorchCheckpointEngine -", proc.stderr


def test_find_spec_probe_before_import_deepspeed_keeps_the_hook(venv, tmp_path):
    """HF transformers/accelerate call ``importlib.util.find_spec("deepspeed")`` before they
    import it: the engines DeepSpeed builds afterwards still go through the cache."""
    probe = "import importlib.util; assert importlib.util.find_spec('deepspeed'); "
    nowhere = str(tmp_path / "no-daemon.sock")
    proc = _run(venv, probe + ENGINE, CKPTCACHE_DEEPSPEED="files", CKPTCACHE_SOCKET=nowhere)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "CkptCacheCheckpointEngine files"


def test_editable_install_ships_the_hook_too(tmp_path):
    target = tmp_path / "site"
    _pip("--target", str(target), "-e", str(_copy_sources(tmp_path / "src")))
    assert (target / PTH).read_text() == (REPO / PTH).read_text()
    assert list(target.glob("__editable__.ckptcache-*.pth"))


def test_environment_variable_alone_routes_save_and_load(venv, daemon_factory, tmp_path):
    """Save and load of a script that never imports ckptcache go through the daemon."""
    d = daemon_factory("--memory-limit", "1GiB")  # memory only: files come from the cache
    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in daemon_env(d).items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(venv.python), str(SCRIPTS / "ds_env_worker.py"), str(ck), str(out)],
        env={**env, "CKPTCACHE_DEEPSPEED": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    assert proc.stdout.count("ENGINE CkptCacheCheckpointEngine") == 4  # 2 engines x 2 ranks
    with d.client() as c:
        cached = {Path(o.path).name for o in c.list(str(ck / TAG))}
        assert cached == {
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        }
        from_cache = c.load(ck / TAG / "mp_rank_00_model_states.pt", weights_only=False)
    for rank in range(2):
        saved = torch.load(out / f"saved-rank{rank}.pt")
        loaded = torch.load(out / f"loaded-rank{rank}.pt")
        assert saved.keys() == loaded.keys() and saved
        for k in saved:
            assert torch.equal(saved[k], loaded[k]), k
        for name, tensor in from_cache["module"].items():
            assert torch.equal(tensor, saved[f"/m/{name}"]), name


@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_deepspeed_strategy_with_the_variable_only(
    venv, daemon_factory, tmp_path, devices
):
    """Lightning builds the engines (and, with 2 devices, launches the second rank itself);
    ``trainer.save_checkpoint`` and ``fit(ckpt_path=...)`` go through the daemon, and the
    resumed state equals the saved one on every rank."""
    pytest.importorskip("lightning")
    d = daemon_factory("--memory-limit", "1GiB")
    ck, out = tmp_path / "run.ckpt", tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in daemon_env(d).items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(venv.python), str(SCRIPTS / "lightning_ds_worker.py"), str(ck), str(out),
         str(devices)],
        env={**env, "CKPTCACHE_DEEPSPEED": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    assert proc.stdout.count("ENGINE CkptCacheCheckpointEngine") == 2 * devices
    with d.client() as c:
        cached = {Path(o.path).name for o in c.list(str(ck / "checkpoint"))}
        assert cached == {"mp_rank_00_model_states.pt"} | {
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(devices)
        }
        from_cache = c.load(ck / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False)
    assert from_cache["global_step"] == 3  # Lightning's client state, kept by DeepSpeed
    for rank in range(devices):
        saved = torch.load(out / f"saved-rank{rank}.pt")
        loaded = torch.load(out / f"loaded-rank{rank}.pt")
        assert saved.keys() == loaded.keys() and saved
        for k in saved:
            assert torch.equal(saved[k], loaded[k]), k
        for name, tensor in from_cache["module"].items():
            assert torch.equal(tensor, saved[f"/m/{name}"]), name
