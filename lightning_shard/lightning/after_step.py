"""What the strategy does once an optimizer step has run: the step's gradients freed at once, where Lightning would
free them only after the next forward, the step's communication figures logged, and a warning, once, where the norms
of Lightning's ``grad_norm`` (of the shards) were logged.

Lightning's automatic optimization calls ``zero_grad`` between a step's forward and its backward
(``training_step``, ``zero_grad``, ``backward``), so the last step's gradient shards stay alive through the whole next
forward, beside its activations: 4 bytes per parameter over N ranks at the forward's peak (a 1.27B GPT at one rank,
bf16-mixed: 4.9 of 23.7 GB). Freeing them right after the step changes no number: nothing computes with them before
that ``zero_grad`` but a module that keeps gradients across steps (its own ``optimizer_zero_grad``), and a hook that
reads them there (``on_before_zero_grad``) would find them gone. With either overridden (by the module, or the latter
by a callback), or under manual optimization (where the user places ``zero_grad``), Lightning's timing is kept.
Code that reads gradients after the step elsewhere (after ``optimizer.step()`` in an overridden ``optimizer_step``,
in ``on_train_batch_end``) finds None there, and ``strategy.grad_norm()`` an empty dict: read them before the step
(``on_before_optimizer_step``), or pass ``free_grads_after_step=False``. Decided at setup, from the code every rank
runs: the same on every rank.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

_KEEPING_HOOKS = ("on_before_zero_grad", "optimizer_zero_grad")


def frees_grads_after_step(trainer: "pl.Trainer", asked: bool) -> bool:
    """Whether the strategy may free the gradients right after each optimizer step (``asked``: its option)."""
    module = trainer.lightning_module
    if not asked or not module.automatic_optimization:
        return False
    if any(is_overridden(hook, module, pl.LightningModule) for hook in _KEEPING_HOOKS):
        return False
    return not any(is_overridden("on_before_zero_grad", callback, pl.Callback) for callback in trainer.callbacks)


def after_step(strategy: Any, optimizer: Optimizer) -> None:
    """``optimizer`` (the raw one) has stepped: free its gradients if setup allowed it, and log the step's figures."""
    if strategy.frees_grads_after_step:  # as LightningModule.optimizer_zero_grad calls it (set_to_none: its default)
        stepper = strategy.runtime.host_stepper if strategy.runtime is not None else None
        if stepper is not None:  # offload: not waiting for the units still to step (finish_in_forward)
            stepper.deferred.free_grads_after_step(optimizer)
        else:
            optimizer.zero_grad()
    trainer: Optional[pl.Trainer] = getattr(strategy.lightning_module, "_trainer", None)
    if trainer is not None:
        warn_if_shard_norms_logged(strategy, trainer)
    if trainer is None or not trainer.loggers or not strategy.is_global_zero or not _logs_this_step(trainer):
        return
    # on a GPU, reading the exposed time waits for the step's last hand-over: once per logged step, as Lightning's
    # own logging (log_every_n_steps), not once per step
    metrics = {f"shard/{k}": float(v) for k, v in strategy.comm_stats.items()}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _logs_this_step(trainer: "pl.Trainer") -> bool:
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


# how Lightning's ``grad_norm(module, norm_type)`` names its values: ``grad_2.0_norm/<name>``, ``grad_2.0_norm_total``
_GRAD_NORM_KEY = re.compile(r"(^|/)grad_(\d+(\.\d+)?|inf)_norm")


def warn_if_shard_norms_logged(strategy: Any, trainer: "pl.Trainer") -> None:
    """Lightning's ``grad_norm(self, 2)`` reads ``p.grad`` of the parameters it finds, this rank's 1-D shards: its
    values are each rank's part of the norms, not the norms. Nothing in it can be corrected from here, so what it logs
    is told once (rank 0's values are the ones logged): values named as it names them, logged where the strategy's
    own ``grad_norm`` (the same names, the unsharded model's numbers) was never called."""
    if strategy.runtime is None or strategy.runtime.grad_norms_read or strategy.told_shard_norms:
        return
    logged = [key for key in trainer.callback_metrics if _GRAD_NORM_KEY.search(key)]
    if logged:
        strategy.told_shard_norms = True
        rank_zero_warn(
            f"lightning_shard: the logged {logged[0]!r} (and {len(logged) - 1} more) look like Lightning's"
            " `grad_norm(module, norm_type)`, which under ShardStrategy reads each rank's 1-D shard of every gradient:"
            " its values are rank 0's part of each norm, not the norm. Log `self.trainer.strategy.grad_norm(norm_type)`"
            " instead (the same names, the unsharded model's norms; every rank must call it: one all-reduce).")
