"""A tiny Lightning run with the CkptCacheIO plugin: reference, crash after a save, resume.

Three steps per epoch, a checkpoint at the end of each epoch (Lightning restarts an epoch's
plain DataLoader on resume, so epoch boundaries make the resumed run comparable).

usage: lightning_trainer.py MODE CKPT_DIR OUT_DIR   (MODE: reference | crash | resume)
"""

from __future__ import annotations

import os
import signal
import sys

import torch

CRASH_AT = 3


def main(mode: str, ck: str, out: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from ckptcache.adapters.lightning import CkptCacheIO

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch, _idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class CrashAfterSave(Callback):
        def on_train_epoch_start(self, trainer, *_args) -> None:
            if trainer.current_epoch == 1:  # epoch 0's checkpoint (step 3) was saved just before
                print("CHECKPOINT-SAVED", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(12, 8, generator=g), torch.randn(12, 1, generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    callbacks: list = [ModelCheckpoint(dirpath=ck, save_top_k=-1)]
    if mode == "crash":
        callbacks.append(CrashAfterSave())
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
        plugins=[CkptCacheIO()] if mode != "reference" else [],
        enable_checkpointing=True,
    )  # fmt: skip
    model = Tiny()
    ckpt_path = os.path.join(ck, f"epoch=0-step={CRASH_AT}.ckpt") if mode == "resume" else None
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    state = {"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict()["state"]}
    torch.save(state, os.path.join(out, f"{mode}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
