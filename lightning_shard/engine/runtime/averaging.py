"""An average of a sharded model's weights, as sharded as the model: one flat tensor per unit laid out as its master
shard (1/N of the parameters per rank), and a copy of each buffer.

Every average torch's ``AveragedModel`` computes is elementwise, so a flat shard gives what each whole parameter
would. The first update is a copy; the later ones are ``AveragedModel.update_parameters``'s, function for function:
the user's ``avg_fn`` per tensor or ``multi_avg_fn`` per group of one device and dtype, else the equal average
(SWA: ``_foreach_lerp_`` where torch has foreach kernels, its per-tensor expression elsewhere). ``ema_update`` is
torch's ``get_ema_avg_fn`` evaluated in place (two products rounded, then their sum: the same numbers without its
three temporaries). So the average is Lightning's ``WeightAveraging``'s under DDP, to the bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, Optional, Union

import torch
from torch import Tensor
from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from lightning_shard.engine.runtime.hooks import ShardRuntime
from lightning_shard.engine.storage.mixed_shard import MixedShard

# averages the current tensors into the averages in place, given the updates before this one (at least one)
AverageUpdate = Callable[[list[Tensor], list[Tensor], int], None]


def ema_update(decay: float) -> AverageUpdate:
    """``decay * average + (1 - decay) * current``: torch's ``get_ema_avg_fn``, in place."""
    keep, take = decay, 1 - decay

    def update(averages: list[Tensor], currents: list[Tensor], _n_averaged: int) -> None:
        for average, current in zip(averages, currents):
            # average.mul_(keep).add_(current, alpha=take) would fuse the multiply-add: other roundings
            taken = current * take
            if average.is_floating_point():
                average.mul_(keep).add_(taken)
            else:  # an integer buffer (a batch count): the float expression, truncated as copy_ truncates it
                average.copy_(average * keep + taken)
    return update


def averaged_model_update(avg_fn: Optional[Callable] = None, multi_avg_fn: Optional[Callable] = None) -> AverageUpdate:
    """What ``AveragedModel(avg_fn=, multi_avg_fn=).update_parameters`` does after its first update."""

    def update(averages: list[Tensor], currents: list[Tensor], n_averaged: int) -> None:
        if avg_fn is not None and multi_avg_fn is None:
            for average, current in zip(averages, currents):
                average.copy_(avg_fn(average, current, torch.tensor(n_averaged, device=average.device)))
            return
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for average, current in zip(averages, currents):
            group = groups.setdefault((average.device, average.dtype), ([], []))
            group[0].append(average)
            group[1].append(current)
        for (device, _), (group_averages, group_currents) in groups.items():
            count = torch.tensor(n_averaged, device=device)
            if multi_avg_fn is not None:
                multi_avg_fn(group_averages, group_currents, count)
            elif device.type in _get_foreach_kernels_supported_devices():
                get_swa_multi_avg_fn()(group_averages, group_currents, count)
            else:
                swa = get_swa_avg_fn()
                for average, current in zip(group_averages, group_currents):
                    average.copy_(swa(average, current, count))
    return update


class AveragedShards:
    def __init__(self, runtime: ShardRuntime, update: AverageUpdate, use_buffers: bool = True,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        """``update``: how an update after the first averages the model in (``ema_update``, ``averaged_model_update``);
        ``use_buffers``: average the buffers too (else they follow the model's, copied at each update);
        ``device``: where the average lives (by default beside each master shard: on the host when offloaded)."""
        self.runtime = runtime
        self._update = update
        self.use_buffers = use_buffers
        self.n_averaged = 0  # updates so far; the first one copies
        mixed = [unit.name for unit in runtime.units if isinstance(unit.storage, MixedShard)]
        if mixed:  # their shards are bytes (engine/storage/mixed_shard.py): averaged as numbers they would be garbage
            raise ValueError(
                f"lightning_shard: units {mixed[:4]} hold parameters of several dtypes (a bf16 base beside fp32"
                " adapters, packed 4-bit weights): averaging their weights is not supported. Give the model one dtype"
                " (e.g. precision='bf16-mixed' with an fp32 base), or train without weight averaging.")
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
            pairs = list(self._pairs(buffers=self.use_buffers))
            self._update([average for average, _ in pairs],
                         [current.to(average.device) for average, current in pairs], self.n_averaged)
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
