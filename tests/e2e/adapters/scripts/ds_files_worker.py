"""DeepSpeed's own small files of a save through the cache: ``latest`` and the recovery scripts.

usage: ds_files_worker.py CKPT_DIR HOW

HOW: ``hook`` (``enable()`` before any engine: the process-wide hook) or ``engine``
(``enable(engine)`` on a built engine). One rank, ZeRO 2, ``commit_waits="local"`` (the
checks are on the files DeepSpeed writes itself, not on the payloads). Checked after each
save: ``latest`` names the tag just saved (never when ``save_latest=False``), with the mode
DeepSpeed's ``open`` gives it under this process's umask, and no temporary file is left; the
recovery scripts hold DeepSpeed's bytes and are executable, are rewritten when the copy in the
directory differs, and are not rewritten when it does not; ``load_checkpoint`` and
``zero_to_fp32`` read the tag ``latest`` names, equal to the live state.
"""

from __future__ import annotations

import os
import stat
import sys

import torch
from _dist import DEEPSPEED, deepspeed_without_compiled_ops, launch, tensors_of

UMASK = 0o027
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def build(seed: int) -> object:
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10_000,
        "checkpoint": {"ckptcache": {"commit_waits": "local"}},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    return engine


def step(engine: object, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    loss = engine(torch.randn(2, 8, generator=g)).pow(2).mean()  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]


def source(name: str) -> bytes:
    import deepspeed

    with open(os.path.join(os.path.dirname(deepspeed.__file__), "utils", name), "rb") as f:
        return f.read()


def check_files(ck: str, latest: str) -> dict[str, tuple[int, int]]:
    """The checks after a save; returns each script's (inode, mtime_ns)."""
    path = os.path.join(ck, "latest")
    with open(path) as f:
        assert f.read() == latest, latest
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~UMASK, oct(os.stat(path).st_mode)
    assert not [n for n in os.listdir(ck) if n.startswith(".")], os.listdir(ck)
    seen = {}
    for name in SCRIPTS:
        script = os.path.join(ck, name)
        with open(script, "rb") as f:
            assert f.read() == source(name), name
        st = os.stat(script)
        assert st.st_mode & stat.S_IXUSR, name
        seen[name] = (st.st_ino, st.st_mtime_ns)
    return seen


def run(rank: int, world: int, ck: str, how: str) -> None:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import ckptcache.adapters.deepspeed as ds_cache

    os.umask(UMASK)
    deepspeed_without_compiled_ops()
    if how == "hook":
        ds_cache.enable()
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build(0)
    if how == "engine":
        ds_cache.enable(engine)
    assert isinstance(engine.checkpoint_engine, ds_cache.CkptCacheCheckpointEngine)
    step(engine, 0)

    engine.save_checkpoint(ck, tag="a")
    check_files(ck, "a")

    # A script changed in the directory, another no longer executable: both made DeepSpeed's.
    with open(os.path.join(ck, "zero_to_fp32.py"), "ab") as f:
        f.write(b"# edited\n")
    os.chmod(os.path.join(ck, "zero_to_torch.py"), 0o644)
    step(engine, 1)
    engine.save_checkpoint(ck, tag="b")
    before = check_files(ck, "b")

    # Unchanged: not written again (same files, same modification times).
    step(engine, 2)
    engine.save_checkpoint(ck, tag="c", client_state={"step": 3})
    assert check_files(ck, "c") == before
    at_c = tensors_of({"m": engine.module.state_dict(), "o": engine.optimizer.state_dict()})

    # save_latest=False: the tag is saved, `latest` still names the one before.
    step(engine, 3)
    engine.save_checkpoint(ck, tag="d", save_latest=False)
    check_files(ck, "c")

    # Tag d is saved whole; `latest` leads DeepSpeed's own readers to tag c, read back whole.
    at_d = tensors_of({"m": engine.module.state_dict(), "o": engine.optimizer.state_dict()})
    fresh = build(1)
    if how == "engine":
        ds_cache.enable(fresh)
    for tag, expected in (("d", at_d), (None, at_c)):
        path, client_state = fresh.load_checkpoint(ck, tag=tag)
        assert path is not None, tag
        loaded = tensors_of({"m": fresh.module.state_dict(), "o": fresh.optimizer.state_dict()})
        assert loaded.keys() == expected.keys() and loaded
        for k in loaded:
            assert torch.equal(loaded[k], expected[k]), (tag, k)
    assert client_state["step"] == 3  # tag c's
    fp32 = get_fp32_state_dict_from_zero_checkpoint(ck)  # reads `latest` and tag c's files
    for k, v in fresh.module.state_dict().items():
        assert torch.equal(fp32[k], v), k
    print("DSFILES-OK", flush=True)


if __name__ == "__main__":
    launch(run, 1, sys.argv[1], sys.argv[2], preload=DEEPSPEED)
