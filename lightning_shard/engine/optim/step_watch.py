"""What runs before every optimizer step over a sharded model's parameters, whoever calls it: the engine's sharded
step, a raw ``optimizer.step()``, a gradient scaler's ``step``. One global optimizer step pre-hook per runtime
(torch's ``register_optimizer_step_pre_hook``): an optimizer the engine was never told of is seen too.

And where gradients are sharded, a ``torch.amp.GradScaler``'s ``unscale_`` of such an optimizer agrees across ranks
on whether it found an inf: each rank checks only its own gradient shard, so one rank would skip the step while
another takes it, and their scales part ways (FSDP2's DTensor gradients all-reduce ``found_inf`` alike;
``ShardedGradScaler`` does it in its own ``unscale_``). One tiny all-reduce per ``unscale_``, which every rank calls.

Before the step:

* gathered copies that user code could write (a weight constraint in ``on_before_zero_grad``, after a manual
  step) are written back to the shards, so the step updates what the model holds (``FlatShard.write_back``);
* the ``nonfinite`` policy: a step whose gradient shards are not finite on some rank is skipped on every rank (or
  stops). At the step, not at the end of each backward: with gradient accumulation an infinite micro-batch then
  skips the whole step (the accumulated gradient is not finite) instead of being dropped alone, and a gradient
  scaler sees the overflow first and backs off its scale (it calls ``step`` only when it found none).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_shard.engine.comm import collectives

_WATCHES: "weakref.WeakSet[StepWatch]" = weakref.WeakSet()  # every runtime's, for the gradient scaler's agreement
_PLAIN_UNSCALE = torch.amp.GradScaler._unscale_grads_


class StepWatch:
    """The runtime's step pre-hook. Holds the runtime weakly: a model dropped takes its hook with it."""

    def __init__(self, runtime: Any) -> None:  # the ShardRuntime (hooks.py), which holds this
        self._runtime = weakref.ref(runtime)
        self._ours = {id(p) for unit in runtime.units
                      for p in (*unit.storage.shard_params, *unit.storage.gathered_params)}
        self._sharded = any(unit.storage.world_size > 1 for unit in runtime.units)
        self.handle = register_optimizer_step_pre_hook(self._before_step)
        weakref.finalize(runtime, self.handle.remove)
        if self._sharded:
            _WATCHES.add(self)
            torch.amp.GradScaler._unscale_grads_ = _unscale_grads_agreed

    def _steps_ours(self, optimizer: Optimizer) -> bool:
        return any(id(p) in self._ours for group in optimizer.param_groups for p in group["params"])

    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        runtime = self._runtime()
        if runtime is None or not self._steps_ours(optimizer):
            return None
        if runtime.host_stepper is not None and runtime.host_stepper.on_worker():
            # offload's overlapped step of one unit, whose optimizer's step calls its parent class's (torch hooks each
            # class's step): the sharded step ran this once for the whole step, on the host's thread; here it would
            # agree on the gradients (a collective) from the worker's thread, in any order with the host's
            return None
        for unit in runtime.units:  # what code wrote into gathered copies (a constraint inside a step): stepped on
            runtime.schedule.write_back(unit)
        if runtime.nonfinite is None:
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:  # (the engine's sharded step ran its closure already)
            runtime.apply_nonfinite_policy()
            return None
        # a raw step given a closure calls it after its hooks: the gradients exist once it returns
        checked = _checked(closure, runtime.apply_nonfinite_policy)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": checked}
        return (args[0], checked, *args[2:]), kwargs


def _checked(closure: Callable[[], Any], check: Callable[[], None]) -> Callable[[], Any]:
    def closure_then_check() -> Any:
        loss = closure()  # (under enable_grad: the optimizer's step calls it so)
        check()
        return loss

    return closure_then_check


def _unscale_grads_agreed(scaler: torch.amp.GradScaler, optimizer: Optimizer, inv_scale: torch.Tensor,
                          found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
    """``GradScaler._unscale_grads_``, then, for an optimizer over sharded gradients, whether any rank found an inf:
    the same answer on every rank (a rank holding no gradient at all gets it too, or its ``update()`` would find no
    inf check recorded)."""
    per_device = _PLAIN_UNSCALE(scaler, optimizer, inv_scale, found_inf, allow_fp16)
    runtime = next((w._runtime() for w in list(_WATCHES) if w._runtime() is not None and w._steps_ours(optimizer)),
                   None)
    if runtime is None or isinstance(scaler, ShardedGradScaler):  # (which agrees in its own unscale_)
        return per_device
    local = torch.zeros(1, dtype=torch.float32)
    for value in per_device.values():
        local = torch.maximum(local, value.detach().reshape(1).float().cpu())
    agreed = collectives.agree(local, runtime.group, runtime.stats, label="agreement on the gradient scaler's infs")
    for value in per_device.values():
        value.copy_(agreed.reshape(()).to(value.device))
    if not per_device:
        per_device[found_inf.device] = agreed.reshape(()).to(found_inf.device)
    return per_device
