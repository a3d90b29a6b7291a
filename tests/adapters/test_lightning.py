"""Lightning Trainer.fit with the CkptCacheIO plugin, killed after a checkpoint and resumed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.adapters.conftest import run_script
from tests.adapters.scripts._dist import tensors_of

pytest.importorskip("lightning")


def test_fit_killed_then_resumed_from_the_cache(daemon_factory, tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    d = daemon_factory("--persist-root", str(ck))
    run_script("lightning_trainer.py", "reference", str(tmp_path / "ref-ck"), str(out))
    run_script("lightning_trainer.py", "crash", str(ck), str(out), daemon=d, expect_kill=True)
    with d.client() as c:
        assert c.exists(ck / "epoch=0-step=3.ckpt")
    run_script("lightning_trainer.py", "resume", str(ck), str(out), daemon=d)
    ref, res = (tensors_of(torch.load(out / f"{m}.pt")) for m in ("reference", "resume"))
    assert ref.keys() == res.keys() and ref
    for k in ref:
        assert torch.equal(ref[k], res[k]), k
    with d.client() as c:
        c.wait(prefix=str(ck), timeout=120)
    # Cache off: Lightning's own format, readable by torch.load.
    final = torch.load(ck / "epoch=1-step=6.ckpt", weights_only=False)
    assert final["global_step"] == 6 and "state_dict" in final


def test_remove_checkpoint_drops_cache_and_file(daemon_factory, tmp_path, monkeypatch):
    from ckptcache.adapters.lightning import CkptCacheIO

    d = daemon_factory("--persist-root", str(tmp_path))
    io = CkptCacheIO(client=d.client())
    path = tmp_path / "a.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.ones(3))
    io.remove_checkpoint(path)
    assert not path.exists() and not io.client.exists(path)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(path)


def test_remove_checkpoint_of_a_directory_removes_it_whole(daemon_factory, tmp_path):
    """A directory checkpoint (DeepSpeedStrategy's ``<name>.ckpt/checkpoint/...``) is removed
    recursively, as TorchCheckpointIO does, and the objects the cache holds below it go too."""
    from ckptcache.adapters.lightning import CkptCacheIO

    d = daemon_factory("--persist-root", str(tmp_path))
    io = CkptCacheIO(client=d.client())
    ck = tmp_path / "epoch=0-step=2.ckpt"
    (ck / "checkpoint").mkdir(parents=True)
    (ck / "latest").write_text("checkpoint")
    model = ck / "checkpoint" / "mp_rank_00_model_states.pt"
    io.client.save({"w": torch.ones(3)}, model)
    io.remove_checkpoint(ck)
    assert not ck.exists()
    assert not io.client.exists(model) and io.client.list(str(ck)) == []


def test_url_checkpoints_stay_urls(daemon, s3_bucket, s3_server, tmp_path, monkeypatch):
    """An ``s3://`` path is a URL end to end: no ``./s3:/<bucket>`` directory appears, and
    removal drops the cached object and the stored one."""
    from ckptcache.adapters.lightning import CkptCacheIO

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    io = CkptCacheIO(client=daemon.client())
    path = f"s3://{s3_bucket}/run/epoch=0.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)
    assert list(cwd.iterdir()) == []
    assert torch.equal(io.load_checkpoint(path)["w"], torch.ones(3))
    io.remove_checkpoint(path)
    assert not io.client.exists(path)
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_bucket, Key="run/stored.ckpt", Body=b"stored")  # type: ignore[attr-defined]
    io.remove_checkpoint(f"s3://{s3_bucket}/run/stored.ckpt")
    listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="run/")  # type: ignore[attr-defined]
    assert listed.get("KeyCount") == 0
    assert list(cwd.iterdir()) == []


def test_load_checkpoint_maps_to_the_cpu_by_default(client, tmp_path, monkeypatch):
    """As TorchCheckpointIO (``map_location=lambda storage, loc: storage``): a checkpoint whose
    tensors were saved on a GPU loads onto the CPU, on a machine with or without one."""
    from ckptcache.adapters.lightning import CkptCacheIO

    io = CkptCacheIO(client=client)
    path = tmp_path / "gpu.ckpt"
    with monkeypatch.context() as m:  # saved as if from cuda:0
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        io.save_checkpoint({"w": torch.arange(4.0)}, path)
    out = io.load_checkpoint(path)
    assert out["w"].device == torch.device("cpu") and torch.equal(out["w"], torch.arange(4.0))


@pytest.mark.parametrize("aware", [False, True], ids=["stock", "cache-aware"])
def test_model_checkpoint_names_see_cached_checkpoints(client, tmp_path, aware):
    """Top-3 by a monitored metric, a filename without epoch or step, nothing persisted (a
    memory-only daemon): the stock ModelCheckpoint sees no file and saves every epoch as
    m.ckpt, overwriting the checkpoints it means to keep; CkptCacheModelCheckpoint also asks
    the cache and picks m-v1.ckpt, m-v2.ckpt, as the stock one does when the files exist."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ckptcache.adapters.lightning import CkptCacheIO, CkptCacheModelCheckpoint

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"], on_step=False, on_epoch=True)
            return out

    ck = tmp_path / "ck"
    cls = CkptCacheModelCheckpoint if aware else ModelCheckpoint
    callback = cls(dirpath=ck, filename="m", monitor="train_loss", save_top_k=3)
    trainer = Trainer(
        max_epochs=3, limit_train_batches=2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        plugins=[CkptCacheIO(client=client)], accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(Model())
    names = sorted(Path(o.path).name for o in client.list(str(ck)))
    assert not list(ck.glob("*.ckpt"))  # nothing is a file: the names came from the cache
    if aware:
        assert names == ["m-v1.ckpt", "m-v2.ckpt", "m.ckpt"]
        assert sorted(Path(p).name for p in callback.best_k_models) == names
        steps = sorted(client.load(ck / n, weights_only=False)["global_step"] for n in names)
        assert steps == [2, 4, 6]  # three checkpoints kept, none overwritten
    else:
        assert names == ["m.ckpt"]  # one name, overwritten each epoch
