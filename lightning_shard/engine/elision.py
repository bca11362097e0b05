"""Backward gather elision: a unit's parameters are needed in backward only if autograd saved them.

A saved-tensor hook active during each step's forward records exactly which gathered buffers autograd kept.
A unit whose buffer was not saved (e.g. an embedding fed token ids: its backward needs only the indices) is
not all-gathered again in backward; its gradient is still reduce-scattered. Recomputation under activation
checkpointing calls the unit's modules again, which gathers them like any forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_shard.engine.gather import GatherSchedule
from lightning_shard.engine.unit import Unit


class BackwardElision:
    def __init__(self, units: list[Unit], schedule: GatherSchedule, enabled: bool) -> None:
        self.units = units
        self.schedule = schedule
        self.enabled = enabled
        self._saved_hooks: Optional[Any] = None

    def start_forward(self) -> None:
        if not self.enabled:
            return
        for unit in self.units:
            unit.saved_for_backward = False
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved_hooks.__enter__()

    def end_forward(self) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    def needs_backward_gather(self, unit: Unit) -> bool:
        # a unit whose gathered buffer is its shard moves no data to gather: nothing to skip there
        needed = unit.saved_for_backward or unit.checkpointed or unit.storage.aliases_shard or not self.enabled
        return unit.reshard_after_forward and needed

    def _pack(self, tensor: Tensor) -> Tensor:
        """Saved-tensor hook: note the unit whose gathered buffer autograd keeps for backward."""
        if tensor.device.type != "meta":
            unit = self.schedule.unit_of_storage(tensor.untyped_storage().data_ptr())
            if unit is not None:
                unit.saved_for_backward = True
        # a detached alias, not the tensor itself: an op's own output saved as-is would form a reference cycle
        return tensor.detach() if not tensor.requires_grad or tensor.grad_fn is not None else tensor


def _unpack(tensor: Tensor) -> Tensor:
    return tensor
