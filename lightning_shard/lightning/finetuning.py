"""Lightning's fine-tuning callbacks (``BaseFinetuning``: ``BackboneFinetuning`` and the user's own) under sharding.

* **Which parameters a callback adds.** ``BaseFinetuning.filter_on_optimizer`` leaves out a parameter that
  ``torch.equal``s one the optimizer holds, meaning to leave out the ones it holds already. Between steps a
  sharded model's parameters are 1-D shards, which compare equal where the parameters do not (every empty shard,
  a zero-initialised bias and a zero-initialised head's piece of the same length): on every rank alike, so no
  agreement of the ranks could notice. For a sharded model's optimizer the filter compares identities instead,
  its purpose; one process, comparing values, drops a parameter whose full value equals one the optimizer holds,
  which the sharded run trains.
* **Resuming.** A BaseFinetuning re-adds the param groups it added during fit from its restored state, in
  ``on_fit_start``. Lightning restores callbacks before ``on_fit_start`` for strategies that restore before
  setup (DDP), after it for those that restore after setup (this one must: it loads into the sharded model),
  so the groups would be missing when the optimizer states are loaded. They are re-added here, just before
  (DDP's order).
* **Its record of the groups** names what this rank's optimizer held when the callback added them, before
  the ranks agreed on them. When the ranks' groups had to be merged (``engine/optim/optimizer_groups.py``), the
  record is written again from the merged groups, so that a checkpoint (rank 0's record) holds them whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

_BY_VALUE = BaseFinetuning.filter_on_optimizer  # Lightning's own


def _filter_on_optimizer(optimizer: Optimizer, params: Iterable) -> list:
    """``BaseFinetuning.filter_on_optimizer``: for a sharded model's optimizer, by identity (shards, or the gathered
    parameters a module holds mid-step, as their shards); Lightning's own for any other optimizer."""
    step = getattr(optimizer, "_shard_step", None)
    if step is None:
        return _BY_VALUE(optimizer, params)
    held = {id(step.shard_of(p)) for group in optimizer.param_groups for p in group["params"]}
    params = list(params)
    kept = [p for p in params if id(step.shard_of(p)) not in held]
    if len(kept) < len(params):
        rank_zero_warn("The provided params to be frozen already exist within another group of this optimizer."
                       " Those parameters will be skipped.")  # Lightning's words
    return kept


BaseFinetuning.filter_on_optimizer = staticmethod(_filter_on_optimizer)


def readd_finetuning_groups(trainer: "pl.Trainer") -> None:
    """What BaseFinetuning's ``on_fit_start`` does after a restore (its own hook, not a subclass's override)."""
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning) and callback._restarting:
            BaseFinetuning.on_fit_start(callback, trainer, trainer.lightning_module)


def record_merged_groups(trainer: "pl.Trainer", index: int, optimizer: Optimizer, names: Mapping[int, str]) -> None:
    """Rewrite the callbacks' record of optimizer ``index`` from its groups (``names``: id(parameter) -> name)."""
    params = {p: names.get(id(p)) for group in optimizer.param_groups for p in group["params"]}
    if None in params.values():  # a tensor that is not the model's: BaseFinetuning could not record it either
        return
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning) and index in callback._internal_optimizer_metadata:
            callback._internal_optimizer_metadata[index] = callback._apply_mapping_to_param_groups(
                optimizer.param_groups, params)
