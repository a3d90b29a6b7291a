"""Lightning's ``DeepSpeedStrategy`` with the cache switched on by ``CKPTCACHE_DEEPSPEED=1``
alone: Lightning calls ``deepspeed.initialize``; no line here imports ckptcache.

usage: lightning_ds_worker.py CKPT_DIR OUT_DIR DEVICES

Fits 3 steps on DEVICES ranks (Lightning launches the others), saves with
``trainer.save_checkpoint(CKPT_DIR)`` (DeepSpeed's directory layout), writes each rank's live
state to ``OUT_DIR/saved-rank{r}.pt``; then a fresh ``Trainer`` resumes with
``fit(ckpt_path=CKPT_DIR)`` and its restored state goes to ``OUT_DIR/loaded-rank{r}.pt``.

``DeepSpeedStrategy.setup_environment`` accepts only a ``CUDAAccelerator`` (an ``isinstance``
check), while DeepSpeed itself runs on its CPU accelerator. :class:`CPUStandInForCUDA` is a
``CUDAAccelerator`` whose every device operation is the CPU's; it exists in this test only.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from _dist import deepspeed_without_compiled_ops, tensors_of

ADAPTER = "ckptcache.adapters.deepspeed"


def main(ck: str, out: str, devices: int) -> None:
    assert ADAPTER not in sys.modules
    import lightning as L
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.strategies import DeepSpeedStrategy

    deepspeed_without_compiled_ops()  # imports deepspeed (Lightning would, in fit)
    assert ADAPTER in sys.modules, "the startup hook did not switch the adapter on"

    class CPUStandInForCUDA(CUDAAccelerator):
        """Passes the strategy's CUDA check; places everything on the CPU."""

        def setup_device(self, device: torch.device) -> None:
            assert device.type == "cpu", device

        def setup(self, trainer: Any) -> None:
            pass

        def teardown(self) -> None:
            pass

        def get_device_stats(self, device: Any) -> dict[str, Any]:
            return {}

        @staticmethod
        def parse_devices(devices: Any) -> int:
            return int(devices)

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[torch.device]:
            # Indexed: the strategy checks that device indices match the local ranks.
            return [torch.device("cpu", i) for i in range(int(devices))]

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def is_available() -> bool:
            return True

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(12, 8, generator=g), torch.randn(12, 1, generator=g)
    )

    def trainer() -> L.Trainer:
        return L.Trainer(
            accelerator=CPUStandInForCUDA(), devices=devices,
            strategy=DeepSpeedStrategy(stage=2, process_group_backend="gloo"),
            max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip

    def state(t: L.Trainer) -> dict[str, torch.Tensor]:
        engine = t.strategy.deepspeed_engine
        print(f"ENGINE {type(engine.checkpoint_engine).__name__}", flush=True)
        return tensors_of({"m": engine.module.state_dict(), "o": engine.optimizer.state_dict()})

    torch.manual_seed(0)
    first = trainer()
    first.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    first.save_checkpoint(ck)
    torch.save(state(first), os.path.join(out, f"saved-rank{first.global_rank}.pt"))

    torch.manual_seed(1)  # different initial weights: only the checkpoint can make them equal
    second = trainer()
    second.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ck)
    assert second.global_step == 3, second.global_step
    torch.save(state(second), os.path.join(out, f"loaded-rank{second.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
