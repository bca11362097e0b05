"""An exponential moving average of a sharded model's weights, as sharded as the model: one flat tensor per unit laid
out as its master shard (1/N of the parameters per rank), and a copy of each buffer.

The update is elementwise, so a flat shard gives what each whole parameter would: ``decay * average + (1 - decay) *
current``, the expression of torch's ``get_ema_avg_fn`` evaluated as it is (two products rounded, then their sum),
with the first update a copy, as ``AveragedModel`` does. That makes the average Lightning's ``EMAWeightAveraging``'s
under DDP, to the bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional, Union

import torch
from torch import Tensor

from lightning_shard.engine.hooks import ShardRuntime


class AveragedShards:
    def __init__(self, runtime: ShardRuntime, decay: float, use_buffers: bool = True,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        """``use_buffers``: average the buffers too (else they follow the model's, copied at each update);
        ``device``: where the average lives (by default beside each master shard: on the host when offloaded)."""
        self.runtime = runtime
        self.decay = decay
        self.use_buffers = use_buffers
        self.n_averaged = 0  # updates so far; the first one copies
        with torch.no_grad():
            self.shards = [unit.storage.shard.to(device or unit.storage.shard.device, copy=True)
                           for unit in runtime.units]
            self.buffers = [buffer.to(device or buffer.device, copy=True) for buffer in runtime.root.buffers()]

    def _pairs(self, shards: bool = True, buffers: bool = True) -> Iterator[tuple[Tensor, Tensor]]:
        """(average, the model's tensor) for every unit's shard, then every buffer."""
        if shards:
            yield from zip(self.shards, (unit.storage.shard for unit in self.runtime.units))
        if buffers:
            buffers = list(self.runtime.root.buffers())
            if len(buffers) != len(self.buffers):
                raise RuntimeError(f"lightning_shard: the model has {len(buffers)} buffers, {len(self.buffers)} when its"
                                   " average began: a buffer was registered or removed during fit.")
            yield from zip(self.buffers, buffers)

    @torch.no_grad()
    def update(self) -> None:
        """Average the model's current weights in (each rank its shards; no communication)."""
        if self.n_averaged == 0:
            self.copy_from_model()
        else:
            keep, take = self.decay, 1 - self.decay
            for average, current in self._pairs(buffers=self.use_buffers):
                # average.mul_(keep).add_(current, alpha=take) would fuse the multiply-add: other roundings
                taken = current.to(average.device) * take
                if average.is_floating_point():
                    average.mul_(keep).add_(taken)
                else:  # an integer buffer (a batch count): the float expression, truncated as copy_ truncates it
                    average.copy_(average * keep + taken)
            if not self.use_buffers:
                for average, current in self._pairs(shards=False):
                    average.copy_(current)
        self.n_averaged += 1

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """The average becomes the model's weights (a checkpoint's average was just loaded into the model)."""
        for average, current in self._pairs():
            average.copy_(current)

    @torch.no_grad()
    def swap(self, shards: bool = True, buffers: bool = True) -> None:
        """Exchange the model's weights and the average (validation runs on the average)."""
        for average, current in self._pairs(shards, buffers):
            held = current.clone()
            current.copy_(average)
            average.copy_(held)
        self.runtime.refresh_gathered()

    @contextmanager
    def swapped(self, shards: bool = True, buffers: bool = True) -> Iterator[None]:
        """The model holds the average inside, its own weights again after."""
        self.swap(shards, buffers)
        try:
            yield
        finally:
            self.swap(shards, buffers)
