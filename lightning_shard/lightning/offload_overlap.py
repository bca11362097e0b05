"""When offload's optimizer step may overlap the backward (``engine/optim/host_step.py``), decided at setup from the code
every rank runs, so the same on every rank.

The overlapped step steps each unit as its gradient lands, before Lightning's hooks that run between the backward and
the optimizer step. So it is armed only where none of them can see the difference: automatic optimization, no hook
between ``backward`` and ``optimizer.step`` overridden (by the module: ``backward``, ``on_after_backward``,
``on_before_optimizer_step``, ``configure_gradient_clipping``, ``optimizer_step``; by a callback:
``on_after_backward``, ``on_before_optimizer_step``), no gradient scaler (16-mixed), and clipping, if any, by norm
(``Trainer(gradient_clip_val=...)``, whose norm the step computes itself at the end of backward; read as each step is
armed, so a callback may change it between steps). Elsewhere the offloaded step runs after the hooks, as it always
did: the same numbers, without the overlap.

The staging copies the devices read are made right after each unit's step. Code that writes the parameters between
steps without a version bump would not be seen there: where the module or a callback of yours overrides a hook that
runs between steps, every step still makes its staging copies again at its first gathers
(``ShardRuntime.restage_each_step``), as before; and touching a shard parameter's ``.data`` anywhere (``training_step``
too) makes its unit's copies again (``engine/storage/offload.py``). Where no such hook runs, ``optimizer.step()`` may
also return before every unit is stepped (``finish_in_forward``): the next forward waits for each unit's step as it
gathers it.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

_MODULE_HOOKS_IN_BETWEEN = ("backward", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping",
                            "optimizer_step")
_CALLBACK_HOOKS_IN_BETWEEN = ("on_after_backward", "on_before_optimizer_step")
_CALLBACK_HOOKS_BETWEEN_STEPS = ("on_before_zero_grad", "on_train_batch_end", "on_train_batch_start",
                                 "on_train_epoch_start", "on_train_epoch_end", "on_validation_start",
                                 "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
                                 "on_validation_batch_start", "on_validation_batch_end")
_MODULE_HOOKS_BETWEEN_STEPS = _CALLBACK_HOOKS_BETWEEN_STEPS + ("optimizer_zero_grad", "on_validation_model_eval",
                                                               "on_validation_model_train")
_LIBRARIES = ("lightning.", "pytorch_lightning.", "lightning_shard.")


def overlap_clip(trainer: "pl.Trainer", precision: str, asked: bool) -> Optional[tuple[Optional[float]]]:
    """``(max_norm,)`` (None: no clipping) when the overlapped step may be armed for ``trainer``'s fit; None if not."""
    if not asked:
        return None
    reason = not_overlapped(trainer, precision)
    if reason is not None:  # a user who pays for offload should know where its overlap went
        rank_zero_info(f"lightning_shard: offload's optimizer step runs after the backward, not during it: {reason}.")
        return None
    return _clip(trainer)


def not_overlapped(trainer: "pl.Trainer", precision: str) -> Optional[str]:
    """Why the overlapped step may not be armed for ``trainer``'s fit (what the user can change), or None."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        return "manual optimization"
    if precision == "16-mixed":
        return "precision='16-mixed' (its gradient scaler unscales between backward and step)"
    hooks = [hook for hook in _MODULE_HOOKS_IN_BETWEEN if is_overridden(hook, module, pl.LightningModule)]
    hooks += [f"{type(callback).__name__}.{hook}" for callback in trainer.callbacks
              for hook in _CALLBACK_HOOKS_IN_BETWEEN if is_overridden(hook, callback, pl.Callback)]
    if hooks:
        return f"{', '.join(hooks)} run between backward and step"
    if _clip(trainer) is None:
        return "gradient_clip_algorithm='value'"
    return None


def _clip(trainer: "pl.Trainer") -> Optional[tuple[Optional[float]]]:
    """The clipping Lightning will ask for after the backward: ``(max_norm,)``, ``(None,)`` for none, None where the
    step cannot do it (by value)."""
    clip_val = trainer.gradient_clip_val
    if not clip_val or clip_val <= 0:  # Lightning clips nothing then
        return (None,)
    if trainer.gradient_clip_algorithm not in (None, "norm"):
        return None
    return (float(clip_val),)


def restage_each_step(trainer: "pl.Trainer") -> bool:
    """Whether code of the user's runs between optimizer steps, where it may write parameters unseen."""
    module = trainer.lightning_module
    if any(is_overridden(hook, module, pl.LightningModule) for hook in _MODULE_HOOKS_BETWEEN_STEPS):
        return True
    return any(is_overridden(hook, callback, pl.Callback) for callback in trainer.callbacks
               if not type(callback).__module__.startswith(_LIBRARIES) for hook in _CALLBACK_HOOKS_BETWEEN_STEPS)


def arm_for_step(strategy: Any, optimizer: Any) -> None:
    """The backward of the loss of the last micro-batch of an automatic-optimization step begins (inside Lightning's
    optimizer step): arm the overlapped host step for ``optimizer`` if setup allowed it."""
    if strategy.offload_overlap_clip is None or optimizer is None or strategy.runtime is None:
        return
    clip = _clip(strategy.lightning_module.trainer)  # now: a callback may have changed it since setup
    if clip is not None:  # the next forward waits for each unit's step where no code of the user's runs in between
        strategy.runtime.arm_host_step(optimizer, max_norm=clip[0],
                                       finish_in_forward=not strategy.runtime.restage_each_step)
