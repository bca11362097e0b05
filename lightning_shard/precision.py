"""The precision plugin: Lightning's precision strings mapped onto the engine, and norm clipping that
sees every shard."""

from __future__ import annotations

from typing import Optional, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

SUPPORTED_PRECISION = ("32-true",)


class ShardPrecision(Precision):
    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"lightning_shard does not support `precision={precision!r}`;"
                f" supported: {', '.join(map(repr, SUPPORTED_PRECISION))}."
            )
        self.precision = precision
        self.runtime = None  # set by the strategy once the model is sharded

    @classmethod
    def from_lightning(cls, plugin: Optional[Precision]) -> "ShardPrecision":
        if plugin is None or isinstance(plugin, ShardPrecision):
            return plugin or cls()
        return cls(str(getattr(plugin, "precision", "32-true")))

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        # A local clip_grad_norm_ would see only this rank's shard: the norm must combine all of them.
        assert self.runtime is not None, "norm clipping before the model is sharded"
        self.runtime.clip_grad_norm_(list(self.main_params(optimizer)), float(clip_val))
