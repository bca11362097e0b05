"""What runs before every optimizer step over a sharded model's parameters, whoever calls it: the engine's sharded
step, a raw ``optimizer.step()``, a gradient scaler's ``step``. One global optimizer step pre-hook per runtime
(torch's ``register_optimizer_step_pre_hook``): an optimizer the engine was never told of is seen too.

Before the step:

* a ``torch.amp.GradScaler`` stepping it is refused where gradients are sharded: each rank checks only its own shard
  for infs, so one rank steps while another skips, and their scales part ways (``ShardedGradScaler`` agrees);
* gathered copies that user code could write (a weight constraint in ``on_before_zero_grad``, after a manual
  step) are written back to the shards, so the step updates what the model holds (``FlatShard.write_back``);
* the ``nonfinite`` policy: a step whose gradient shards are not finite on some rank is skipped on every rank (or
  stops). At the step, not at the end of each backward: with gradient accumulation an infinite micro-batch then
  skips the whole step (the accumulated gradient is not finite) instead of being dropped alone, and a gradient
  scaler sees the overflow first and backs off its scale (it calls ``step`` only when it found none).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

# the frames of torch.amp.GradScaler that call `optimizer.step()` (ShardedGradScaler inherits them)
_SCALER_STEPS = (torch.amp.GradScaler.step.__code__, torch.amp.GradScaler._maybe_opt_step.__code__)


class StepWatch:
    """The runtime's step pre-hook. Holds the runtime weakly: a model dropped takes its hook with it."""

    def __init__(self, runtime: Any) -> None:  # the ShardRuntime (hooks.py), which holds this
        self._runtime = weakref.ref(runtime)
        self._ours = {id(p) for unit in runtime.units
                      for p in (*unit.storage.shard_params, *unit.storage.gathered_params)}
        self._sharded = any(unit.storage.world_size > 1 for unit in runtime.units)
        self.handle = register_optimizer_step_pre_hook(self._before_step)
        weakref.finalize(runtime, self.handle.remove)

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
        if self._sharded:
            _refuse_plain_grad_scaler(optimizer)
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


def _refuse_plain_grad_scaler(optimizer: Optimizer, depth: int = 8) -> None:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return
        if frame.f_code in _SCALER_STEPS:
            scaler = frame.f_locals.get("self")
            if (isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, ShardedGradScaler)
                    and scaler.is_enabled()):
                raise RuntimeError(
                    f"lightning_shard: a {type(scaler).__module__}.{type(scaler).__name__} steps"
                    f" {type(optimizer).__name__} over sharded gradients: it checks only this rank's gradient shard"
                    " for infs, so one rank steps while another skips, and their scales part ways. Use"
                    " torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (the same arguments), which"
                    " agrees across ranks; with Lightning, precision='16-mixed' uses it already.")
            return
        frame = frame.f_back
