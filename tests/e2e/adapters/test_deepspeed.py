"""DeepSpeed through the cache: ZeRO 0/2/3, a trainer killed right after a save, resumed."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from tests.e2e.adapters.conftest import run_script, start_script
from tests.helpers import read_only_dir, thread_inside, wait_until

pytest.importorskip("deepspeed")

# Each test launches DeepSpeed three or four times (2 ranks each): on a busy 2-core machine that
# can take longer than the suite's default 300 s limit, which is only a safety net.
pytestmark = pytest.mark.timeout(900)

TAG = "global_step3"


def states(out: Path, mode: str, stage: int = 2) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{mode}-zero{stage}-rank{r}.pt") for r in range(2)]


def assert_states_equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys() and ra
        for k in ra:
            assert torch.equal(ra[k], rb[k]), k


def ds(mode: str, stages: int | list[int], ck: Path, out: Path, daemon=None, **kw):
    arg = ",".join(map(str, stages)) if isinstance(stages, list) else str(stages)
    return run_script("ds_trainer.py", mode, arg, str(ck), str(out), daemon=daemon, **kw)


@pytest.fixture
def local_commit(monkeypatch):
    """The trainers' engines commit after phase 1 (``commit_waits="local"``): what memory
    alone serves is what these tests check."""
    monkeypatch.setenv("CKPTCACHE_COMMIT_WAITS", "local")


STAGES = [0, 2, 3]


def test_crash_then_resume_from_memory(
    daemon_factory, tmp_path, torch_extensions_dir, local_commit
):
    """Memory-only daemon: nothing is ever persisted, the resume still finds its checkpoint.

    ZeRO 0, 2 and 3 each checkpoint into their own directory, trained in turn by the same two
    ranks (one launch per run instead of one per stage); the crash comes after every save."""
    d = daemon_factory("--memory-limit", "1GiB")
    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    ds("reference", STAGES, ck, out)
    ds("crash", STAGES, ck, out, daemon=d, expect_kill=True)
    for stage in STAGES:
        # The trainer died after phase 1: DeepSpeed's `latest` is there, its payloads only in
        # memory.
        tagged = ck / f"zero{stage}" / TAG
        assert (tagged.parent / "latest").read_text() == TAG
        assert not list(tagged.glob("*.pt"))
        with d.client() as c:
            assert {Path(o.path).name for o in c.list(str(tagged))} >= {
                "zero_pp_rank_0_mp_rank_00_model_states.pt"
                if stage == 3
                else "mp_rank_00_model_states.pt"
            }
    ds("resume", STAGES, ck, out, daemon=d)
    for stage in STAGES:
        assert_states_equal(states(out, "resume", stage), states(out, "reference", stage))
    assert list(torch_extensions_dir.iterdir()) == []  # no op was compiled at test time


def test_resume_while_persist_is_pending_then_cache_off(daemon_factory, tmp_path, local_commit):
    """Persist root configured but the tag directory refuses files until after the crash: the
    resume waits for the daemon's persist, and the persisted files are DeepSpeed's own."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    (ck / TAG).mkdir(parents=True)
    out.mkdir()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("persist_retries: 100000\npersist_backoff: 0.05\npersist_backoff_max: 0.2\n")
    d = daemon_factory("--persist-root", str(ck), "--config", str(cfg))
    ds("reference", 2, ck, out)
    with read_only_dir(ck / TAG):
        ds("crash", 2, ck, out, daemon=d, expect_kill=True)
        assert not list((ck / TAG).glob("*.pt"))
        with d.client() as c:
            pending = c.list(str(ck / TAG))
        assert pending and all("persisted" not in o.stages for o in pending)
        resume = start_script("ds_trainer.py", "resume", "2", str(ck), str(out), daemon=d)
        # Both ranks reach load_checkpoint while the files still cannot be written.
        wait_until(lambda: all((out / f"resume-loading-rank{r}").exists() for r in range(2))
                   or resume.poll() is not None, 240, "the resume to start loading")  # fmt: skip
    done = resume.wait(timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert_states_equal(states(out, "resume"), states(out, "reference"))
    # Cache off: plain torch.load and DeepSpeed's default engine read the persisted files.
    files = sorted(p.name for p in (ck / TAG).glob("*.pt"))
    assert files == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert "module" in torch.load(ck / TAG / files[0], weights_only=False)
    ds("plainresume", 2, ck, out)
    assert_states_equal(states(out, "plainresume"), states(out, "reference"))


@pytest.mark.parametrize(
    ("config", "persist"),
    [("files", False), ("files", True), ("default", False)],
    ids=["files-memory-only", "files-persist-root", "defaults-memory-only"],
)
def test_config_only_engines_and_files_readable_right_after_save(
    daemon_factory, tmp_path, config, persist
):
    """Engines switched on by the process-wide hook and the DeepSpeed config; with
    commit_waits="files", which is also what an engine gets with no ckptcache key at all,
    DeepSpeed's own checks right after save_checkpoint (torch.load, os.path.getsize,
    zero_to_fp32) pass with or without a persist root; then the directory is deleted as
    DeepSpeed's tests do."""
    ck = tmp_path / "ck"
    d = daemon_factory(*(["--persist-root", str(ck)] if persist else ["--memory-limit", "1GiB"]))
    proc = run_script("ds_tools_worker.py", str(ck), config, daemon=d)
    assert "DSTOOLS-OK" in proc.stdout
    with d.client() as c:
        cached = {Path(o.path).name for o in c.list(str(ck / TAG))}
    assert "mp_rank_00_model_states.pt" in cached  # the save went through the cache
    shutil.rmtree(ck)


def slow_persist_config(tmp_path: Path) -> Path:
    """A daemon config that retries a refused persist for ever, quickly."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("persist_retries: 100000\npersist_backoff: 0.05\npersist_backoff_max: 0.2\n")
    return cfg


@pytest.mark.parametrize("persist", [False, True], ids=["memory-only", "persist-root"])
def test_fixed_tag_saved_again_returns_with_the_new_files(daemon_factory, tmp_path, persist):
    """commit_waits="files" and a tag saved twice (Lightning's DeepSpeedStrategy always uses
    tag="checkpoint"): commit returns only once the file holds the second save. Under a persist
    root whose directory refuses files, commit is still waiting for the daemon's persist of
    the new generation (the first save's file is there); it returns once that is written."""
    from ckptcache.adapters.deepspeed import CkptCacheCheckpointEngine

    ck = tmp_path / "ck"
    path = ck / "checkpoint" / "mp_rank_00_model_states.pt"
    path.parent.mkdir(parents=True)
    args = ["--persist-root", str(ck), "--config", str(slow_persist_config(tmp_path))]
    d = daemon_factory(*(args if persist else ["--memory-limit", "1GiB"]))
    with d.client() as c:
        engine = CkptCacheCheckpointEngine(None, commit_waits="files", client=c)
        errors: list[BaseException] = []

        def save(w: float) -> None:
            try:
                engine.create(None)
                engine.save({"w": torch.full((4,), w)}, str(path))
                engine.commit(None)
            except BaseException as e:
                errors.append(e)

        save(1.0)
        assert torch.equal(torch.load(path)["w"], torch.full((4,), 1.0))
        if persist:
            with read_only_dir(path.parent):
                t = threading.Thread(target=save, args=(2.0,))
                t.start()
                wait_until(lambda: thread_inside(t, "wait_persisted") or not t.is_alive())
                alive = t.is_alive()
            t.join(120)
            assert alive, "commit returned while the file still held the first save"
        else:
            save(2.0)
        assert not errors, errors
        assert torch.equal(torch.load(path)["w"], torch.full((4,), 2.0))


def test_prepare_load_rewrites_a_file_left_by_an_earlier_save_of_the_tag(client, tmp_path):
    """Memory-only: prepare_load makes the file hold the newest generation, also when a file
    of an earlier save of the same tag is there; a file already current is left alone."""
    from ckptcache.adapters.deepspeed import prepare_load

    path = tmp_path / "ck" / "checkpoint" / "mp_rank_00_model_states.pt"
    path.parent.mkdir(parents=True)  # DeepSpeed makes it before it saves
    client.save({"w": torch.full((4,), 1.0)}, path)
    assert prepare_load(str(tmp_path / "ck"), "checkpoint", client) == 1
    assert torch.equal(torch.load(path)["w"], torch.full((4,), 1.0))
    client.save({"w": torch.full((4,), 2.0)}, path)
    assert prepare_load(str(tmp_path / "ck"), "checkpoint", client) == 1
    assert torch.equal(torch.load(path)["w"], torch.full((4,), 2.0))
    assert prepare_load(str(tmp_path / "ck"), "checkpoint", client) == 0


def test_decoupled_engine_defers_latest_until_the_files_are_there(daemon_factory, tmp_path):
    """``"decoupled": true``: save_checkpoint returns before the files exist (memory-only
    daemon: only the adapter writes them, at the commit), ``latest`` is written at the next
    optimizer step once they do, and zero_to_fp32 then reads the tag (see the worker)."""
    ck = tmp_path / "ck"
    d = daemon_factory("--memory-limit", "1GiB")
    proc = run_script("ds_decoupled_worker.py", str(ck), daemon=d)
    assert "DECOUPLED-OK" in proc.stdout
    assert (ck / "latest").read_text() == "global_step4"


def test_decoupled_follows_deepspeeds_own_writer_setting():
    """DeepSpeed's ``"checkpoint": {"writer": {"decoupled": true}}`` asks for the same protocol;
    the ckptcache key and ``enable(decoupled=...)`` decide before it."""
    from types import SimpleNamespace

    from ckptcache.adapters.deepspeed import _decoupled

    def config(checkpoint: dict) -> SimpleNamespace:
        return SimpleNamespace(_param_dict={"checkpoint": checkpoint})

    writer = config({"writer": {"decoupled": True}})
    assert _decoupled(writer, {}, None) is True
    assert _decoupled(writer, {"decoupled": False}, None) is False
    assert _decoupled(config({}), {}, True) is True
    assert _decoupled(config({}), {}, None) is False
    assert _decoupled(None, {}, None) is False
