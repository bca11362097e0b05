"""``ShardedEMA``: Lightning's ``EMAWeightAveraging`` for a model sharded by ShardStrategy (weight_averaging.py)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from lightning_shard.engine.runtime.averaging import AverageUpdate, ema_update
from lightning_shard.lightning.weight_averaging import ShardedWeightAveraging


class ShardedEMA(ShardedWeightAveraging):
    """An exponential moving average of the weights, updated after optimizer steps: ``decay * average + (1 - decay)
    * weights``. Options as Lightning's ``EMAWeightAveraging``: ``update_every_n_steps``, ``update_starting_at_step``
    and ``update_starting_at_epoch`` say when (override :meth:`should_update` for more); ``use_buffers`` averages
    the buffers too; ``device`` keeps the average elsewhere (``"cpu"``: in host memory, copied there at each
    update)."""

    _lightning_name = "EMAWeightAveraging"

    def __init__(self, decay: float = 0.999, update_every_n_steps: int = 1, update_starting_at_step: Optional[int] = None,
                 update_starting_at_epoch: Optional[int] = None, use_buffers: bool = True,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
            raise ValueError(f"ShardedEMA: `decay` must be a number in [0, 1]; got {decay!r}.")
        for name, value, least in (("update_every_n_steps", update_every_n_steps, 0),
                                   ("update_starting_at_step", update_starting_at_step, 0),
                                   ("update_starting_at_epoch", update_starting_at_epoch, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"ShardedEMA: `{name}` must be an integer >= {least}"
                                 f"{'' if name == 'update_every_n_steps' else ' or None'}; got {value!r}.")
        super().__init__(device=device, use_buffers=use_buffers)
        self.decay = float(decay)
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """After each optimizer step (``step_idx``, zero-based) and each training epoch (``epoch_idx``): update now?"""
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        return epoch_idx is not None and self.update_starting_at_epoch is not None \
            and epoch_idx >= self.update_starting_at_epoch

    def _update_function(self) -> AverageUpdate:
        return ema_update(self.decay)
