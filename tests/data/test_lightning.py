"""CachedDataModule under a real Lightning Trainer (skipped when Lightning is not installed)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="Lightning is not installed")

from ckptcache.data import CachedDataModule  # noqa: E402
from tests.data._dataset import batch_digest  # noqa: E402

N = 6


class _Data(pl.LightningDataModule):
    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N * 2, 3, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2)

    def val_dataloader(self) -> list[int]:
        return [1, 2]


class _Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.seen.append(batch_digest({"x": x, "y": torch.zeros(0), "meta": None}))
        return self.layer(x).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Fault(Exception):
    pass


class _CrashAfter(pl.Callback):
    """Checkpoint after ``steps`` training steps, then fail (the fault to recover from)."""

    def __init__(self, steps: int, path: Path):
        self.steps, self.path = steps, path

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.steps:
            trainer.save_checkpoint(self.path)
            raise _Fault


def _fit(dm: Any, root: Path, *, crash_after: int = 0, ckpt: Path | None = None) -> _Model:
    model = _Model()
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, enable_checkpointing=False,
        limit_val_batches=0, callbacks=[_CrashAfter(crash_after, root / "mid.ckpt")],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        except _Fault:
            pass
    return model


def test_fit_resume_mid_epoch_is_exact(cache_dir: str, tmp_path: Path) -> None:
    plain = _fit(_Data(), tmp_path / "plain").seen
    assert len(plain) == N
    dm = CachedDataModule(_Data(), run_id="lit", cache_dir=cache_dir, prefetch=4)
    first = _fit(dm, tmp_path, crash_after=3).seen
    assert dm.state_dict()["train"]["step"] == 3
    assert os.path.isdir(os.path.join(cache_dir, "lit"))  # the fault kept the cache
    restarted = CachedDataModule(_Data(), run_id="lit", cache_dir=cache_dir, prefetch=4)
    second = _fit(restarted, tmp_path, ckpt=tmp_path / "mid.ckpt").seen
    assert first + second == plain
    assert restarted.val_dataloader() == [1, 2]  # validation is the wrapped module's, uncached
