"""Lightning Trainer.fit with the CkptCacheIO plugin, killed after a checkpoint and resumed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.e2e.adapters.conftest import run_script
from tests.e2e.adapters.scripts._dist import tensors_of
from tests.helpers import wait_until

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
    memory-only daemon, commit_waits="local": no file is written for the checkpoints), so the
    stock ModelCheckpoint sees no file and saves every epoch as
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
        plugins=[CkptCacheIO(client=client, commit_waits="local")], accelerator="cpu", devices=1,
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


def trainer_for(root: Path, plugin, max_epochs: int, *callbacks):
    """A CPU Trainer that checkpoints at the end of each epoch (2 steps) through ``plugin``."""
    from lightning.pytorch import Trainer

    return Trainer(
        max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=list(callbacks) or None, plugins=[plugin], accelerator="cpu", devices=1,
    )  # fmt: skip


def test_default_commit_waits_makes_the_files_lightning_lists(client, tmp_path):
    """Default commit_waits, a memory-only daemon: every checkpoint is a ``.ckpt`` file in
    Lightning's format when ``save_checkpoint`` returns, so Lightning's own directory listing
    finds them: ``fit(ckpt_path="last")`` resumes from ``last.ckpt``."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ckptcache.adapters.lightning import CkptCacheIO

    ck = tmp_path / "ck"

    def callback() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=ck, save_top_k=-1, save_last=True)

    trainer_for(tmp_path, CkptCacheIO(client=client), 2, callback()).fit(BoringModel())
    names = sorted(p.name for p in ck.iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    assert sorted(Path(o.path).name for o in client.list(str(ck))) == names  # via the cache
    assert torch.load(ck / "epoch=1-step=4.ckpt", weights_only=False)["global_step"] == 4
    resumed = trainer_for(tmp_path, CkptCacheIO(client=client), 3, callback())
    resumed.fit(BoringModel(), ckpt_path="last")
    assert resumed.ckpt_path == str(ck / "last.ckpt") and resumed.global_step == 6


def test_async_checkpoint_io_around_the_plugin_writes_the_files(client, tmp_path):
    """``AsyncCheckpointIO(CkptCacheIO())``: Lightning's checkpoint thread does the copy and
    the wait for the file; when ``fit`` returns (Lightning's teardown joins that thread) every
    checkpoint is a file."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from ckptcache.adapters.lightning import CkptCacheIO

    # Every checkpoint kept: a top-k removal may run before the save it removes (Lightning's
    # AsyncCheckpointIO queues saves, not removals), whatever the CheckpointIO.
    keep_all = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1)
    trainer = trainer_for(tmp_path, AsyncCheckpointIO(CkptCacheIO(client=client)), 2, keep_all)
    trainer.fit(BoringModel())
    files = sorted((tmp_path / "ck").glob("*.ckpt"))
    assert [p.name for p in files] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    assert torch.load(files[-1], weights_only=False)["global_step"] == 4


class Wide:
    """A model whose checkpoint (48 MiB: weights and two Adam moments) is large enough for
    the client's parallel copy threads."""

    @staticmethod
    def build():
        import lightning as L

        class WideModel(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(2048, 2048, bias=False)

            def training_step(self, batch, _idx):
                return self.layer(batch).pow(2).mean()

            def train_dataloader(self):
                return torch.utils.data.DataLoader(torch.randn(8, 2048), batch_size=4)

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-3)

        return WideModel()


def client_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads of ckptcache's client started since ``before`` and still alive."""
    return [
        t for t in threading.enumerate()
        if t not in before and t.name.startswith("ckptcache") and t.is_alive()
    ]  # fmt: skip


def test_no_client_thread_outlives_its_work(client, tmp_path, monkeypatch):
    """Lightning's own thread-leak check (its test suite's ``thread_police_duuu_daaa_duuu_daaa``
    fixture) fails a test that leaves a thread behind unless it is a daemon thread with a
    ``stop()``, which it calls. A fit through the plugin starts the client's threads (the spare
    mapper, the parallel copy): each is such a thread, ends by itself once its work is done,
    and a ``stop()`` ends it at once."""
    from ckptcache.adapters.lightning import CkptCacheIO

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the copy runs on 2 threads
    before = set(threading.enumerate())
    trainer_for(tmp_path, CkptCacheIO(client=client), 2).fit(Wide.build())
    started = client_threads(before)
    assert {t.name.rsplit("_", 1)[0] for t in started} <= {"ckptcache-spares", "ckptcache-copy"}
    for t in started:  # what Lightning's check accepts
        assert t.daemon and callable(getattr(t, "stop", None)), t
    wait_until(lambda: not client_threads(before), what="the client's threads to end")

    io = CkptCacheIO(client=client)
    io.save_checkpoint({"w": torch.randn(4 << 20)}, tmp_path / "one.ckpt")  # 16 MiB
    for t in client_threads(before):  # what Lightning's check does
        t.stop()
        assert not t.is_alive(), t
