"""``CachedDataModule``: :class:`CachedDataLoader` for a Lightning ``LightningDataModule``.

Importing this module needs ``lightning`` (or the older ``pytorch_lightning``); the rest of
``ckptcache.data`` does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from lightning.pytorch import LightningDataModule
except ImportError:
    try:
        from pytorch_lightning import LightningDataModule  # type: ignore[assignment]
    except ImportError as e:
        raise ImportError(
            "ckptcache.data.CachedDataModule needs Lightning: pip install lightning "
            "(or use ckptcache.data.CachedDataLoader directly)"
        ) from e

from ckptcache.data.loader import CachedDataLoader, default_loading_rank

__all__ = ["CachedDataModule"]


class CachedDataModule(LightningDataModule):  # type: ignore[misc]
    """Wrap ``data_module`` so its training loader goes through the shared-memory batch cache.

    Only the loading rank sets up the wrapped module and runs its ``train_dataloader``; the
    other ranks of ``group`` read the cached batches. Validation, test and predict loaders are
    the wrapped module's own (they start cold, as they should). The data position is saved in
    the checkpoint (``state_dict``) and restored before the training loader is built, and
    Lightning's own loop state also saves it, since the loader has ``state_dict``. Other
    attributes (``data_sampler``, ...) are delegated to ``data_module``.

    Args:
        data_module: the ``LightningDataModule`` to wrap.
        run_id: see :class:`CachedDataLoader`; keep it stable across restarts of one job.
        is_loading_rank: see :class:`CachedDataLoader`.
        group: see :class:`CachedDataLoader`.
        **loader_kwargs: the other :class:`CachedDataLoader` arguments (``cache_dir``,
            ``prefetch``, ``lookback``, ``max_bytes``, ``timeout``, ``encrypt``, ...).
    """

    def __init__(
        self,
        data_module: Any,
        *,
        run_id: str,
        is_loading_rank: bool | None = None,
        group: Any = None,
        **loader_kwargs: Any,
    ):
        super().__init__()
        self.data_module = data_module
        self.run_id = run_id
        self.group = group
        self.is_loading_rank = (
            default_loading_rank(group) if is_loading_rank is None else is_loading_rank
        )
        self.loader_kwargs = loader_kwargs
        self.train_loader: CachedDataLoader | None = None
        self._trained = 0
        self._pending_state: dict[str, Any] | None = None

    def prepare_data(self) -> None:
        """Delegate (Lightning calls it on one rank per node)."""
        self.data_module.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        """Set up the wrapped module on the loading rank only (readers never touch the data)."""
        if self.is_loading_rank or stage not in (None, "fit"):
            self.data_module.setup(stage)

    def train_dataloader(self) -> CachedDataLoader:
        """The cached training loader (built once, at the restored position)."""
        if self.train_loader is None:
            make = self.data_module.train_dataloader if self.is_loading_rank else None
            self.train_loader = CachedDataLoader(
                make, run_id=self.run_id, is_loading_rank=self.is_loading_rank,
                group=self.group, **self.loader_kwargs,
            )  # fmt: skip
            if self._pending_state is not None:
                self.train_loader.load_state_dict(self._pending_state)
            self.train_loader.held_back = self._held_back(self.train_loader)
            self._trained = 0
        return self.train_loader

    def _held_back(self, loader: CachedDataLoader) -> Callable[[], int]:
        """Batches Lightning took from ``loader`` but has not trained on yet.

        Lightning's data fetcher looks one batch ahead when a loader has no known length
        (ours, until the real loader reports one); the saved position must not count it.
        (Lightning may ask for the state after ``teardown``: bind the loader, not the field.)
        """
        return lambda: max(0, loader.handed_out - self._trained)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count the training batches actually used, then delegate."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            self._trained += 1
        return self.data_module.on_before_batch_transfer(batch, dataloader_idx)

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        """Delegate."""
        return self.data_module.transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Delegate."""
        return self.data_module.on_after_batch_transfer(batch, dataloader_idx)

    def val_dataloader(self) -> Any:
        """The wrapped module's validation loader, uncached."""
        return self.data_module.val_dataloader()

    def test_dataloader(self) -> Any:
        """The wrapped module's test loader, uncached."""
        return self.data_module.test_dataloader()

    def predict_dataloader(self) -> Any:
        """The wrapped module's predict loader, uncached."""
        return self.data_module.predict_dataloader()

    def state_dict(self) -> dict[str, Any]:
        """The training data position (saved by Lightning in every checkpoint)."""
        if self.train_loader is not None:
            return {"train": self.train_loader.state_dict()}
        return {"train": self._pending_state} if self._pending_state else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position; applied when (or if already) the training loader exists."""
        self._pending_state = state_dict.get("train")
        self._trained = 0
        if self.train_loader is not None and self._pending_state is not None:
            self.train_loader.load_state_dict(self._pending_state)

    def teardown(self, stage: str | None = None) -> None:
        """Stop prefetching. Batches are kept: teardown also runs when training failed."""
        if self.is_loading_rank or stage not in (None, "fit"):
            self.data_module.teardown(stage)
        if stage in (None, "fit") and self.train_loader is not None:
            self._pending_state = self.train_loader.state_dict()  # saved after fit, too
            self.train_loader.close(keep_cache=True)
            self.train_loader = None

    def __getattr__(self, name: str) -> Any:
        if name == "data_module":  # not set yet (during __init__): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.data_module, name)
