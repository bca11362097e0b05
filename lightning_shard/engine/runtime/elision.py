"""Backward gather elision: a unit's parameters are needed in backward only if autograd saved them.

A saved-tensor hook active during each step's forward records exactly which gathered buffers autograd kept.
A unit whose buffer was not saved (e.g. an embedding fed token ids: its backward needs only the indices) is
not all-gathered again in backward; its gradient is still reduce-scattered. Recomputation under activation
checkpointing calls the unit's modules again, which gathers them like any forward.

Checkpointing the engine cannot see (a ``torch.utils.checkpoint`` region inside a unit member's forward, as
HF transformers' ``gradient_checkpointing_enable()`` puts around each layer's ``forward``) reads parameters
in forward that the hook never sees saved, and reads them again when backward recomputes the region: a
non-reentrant region saves under its own saved-tensor hook (innermost wins), a reentrant one runs under
``no_grad``. So while the hook is active a torch-function mode also watches every op: one that reads a
gathered buffer with grad disabled, or under a saved-tensor hook other than ours, marks the unit as needed
in backward (conservative: a parameter read under ``no_grad`` for, say, a norm also keeps its unit gathered).
The price is a Python call per op in forward, only with elision on.

Off by default: while the hook is active autograd cannot run its in-place version check on saved tensors
(``z = y.exp(); z.mul_(0)`` then backward gives silent zeros instead of an error). When on, the ranks agree
per step (one all-reduce of the saved flags at the end of forward), so a unit whose parameters only one
rank saved (a branch taken on its data) is gathered on every rank: never a hang.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats
from lightning_shard.engine.runtime.gather import GatherSchedule
from lightning_shard.engine.storage.unit import Unit


class BackwardElision:
    def __init__(self, units: list[Unit], schedule: GatherSchedule, enabled: bool,
                 group: Optional[dist.ProcessGroup], world_size: int, stats: CommStats) -> None:
        self.units = units
        self.schedule = schedule
        # only units freed after forward have a backward gather to skip (not under grad_op / none)
        self.enabled = enabled and any(unit.reshard_after_forward for unit in units)
        schedule.track_storage = self.enabled
        self.group, self.world_size, self.stats = group, world_size, stats
        self._saved_hooks: Optional[Any] = None
        self._reads: Optional[_UnsavedReads] = None

    def start_forward(self) -> None:
        if not self.enabled or not torch.is_grad_enabled():  # grad mode is the same on every rank
            return
        for unit in self.units:
            unit.saved_for_backward = False
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved_hooks.__enter__()
        self._reads = _UnsavedReads(self, self._saved_hooks.pack_hook)
        self._reads.__enter__()

    def end_forward(self) -> None:
        if self._saved_hooks is None:
            return
        if self._reads is not None:
            self._reads.__exit__(None, None, None)
            self._reads = None
        self._saved_hooks.__exit__(None, None, None)
        self._saved_hooks = None
        if self.world_size > 1:  # a unit any rank saved is gathered on all of them
            saved = torch.tensor([unit.saved_for_backward for unit in self.units], dtype=torch.uint8)  # host flags
            collectives.agree(saved, self.group, self.stats, label="agreement on the units to gather in backward")
            for unit, flag in zip(self.units, saved.tolist()):
                unit.saved_for_backward = bool(flag)

    def needs_backward_gather(self, unit: Unit) -> bool:
        # a unit whose gathered buffer is its shard moves no data to gather: nothing to skip there
        needed = unit.saved_for_backward or unit.checkpointed or unit.storage.aliases_shard or not self.enabled
        return unit.reshard_after_forward and needed

    def _pack(self, tensor: Tensor) -> Tensor:
        """Saved-tensor hook: note the unit whose gathered buffer autograd keeps for backward."""
        self._note(tensor)
        # a detached alias, not the tensor itself: an op's own output saved as-is would form a reference cycle
        return tensor.detach() if not tensor.requires_grad or tensor.grad_fn is not None else tensor

    def _note(self, tensor: Tensor) -> None:
        """Mark the unit whose gathered buffer ``tensor`` views (parameter or view of one) as needed in backward."""
        if tensor.layout == torch.strided and tensor.device.type != "meta":  # sparse tensors have no storage
            unit = self.schedule.unit_of_storage(tensor.untyped_storage().data_ptr())
            if unit is not None:
                unit.saved_for_backward = True


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


class _UnsavedReads(TorchFunctionMode):
    """Notes the gathered buffers that ops read where the saved-tensor hook cannot see what autograd keeps:
    grad disabled (a reentrant checkpoint's region, or a custom ``autograd.Function``'s forward), or another
    saved-tensor hook on top of ours (a non-reentrant checkpoint's region, ``save_on_cpu``). Backward may
    read those parameters again (a recomputation), so their units are gathered there."""

    def __init__(self, elision: BackwardElision, pack_hook: Any) -> None:
        super().__init__()
        self.elision, self.pack_hook = elision, pack_hook

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not torch.is_grad_enabled() or not self._ours_on_top():
            # an op takes tensors as arguments or in one list (torch.cat): no need for a full tree_flatten
            for x in (*args, *kwargs.values()):
                if isinstance(x, Tensor):
                    self.elision._note(x)
                elif isinstance(x, (list, tuple)):
                    for y in x:
                        if isinstance(y, Tensor):
                            self.elision._note(y)
        return func(*args, **kwargs)

    def _ours_on_top(self) -> bool:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] is self.pack_hook
