"""Lightning's fine-tuning callbacks (``BaseFinetuning``: ``BackboneFinetuning`` and the user's own) under sharding.

* **Resuming.** A BaseFinetuning re-adds the param groups it added during fit from its restored state, in
  ``on_fit_start``. Lightning restores callbacks before ``on_fit_start`` for strategies that restore before
  setup (DDP), after it for those that restore after setup (this one must: it loads into the sharded model),
  so the groups would be missing when the optimizer states are loaded. They are re-added here, just before
  (DDP's order).
* **Its record of the groups** names what this rank's optimizer held when the callback added them, before
  the ranks agreed on them. When the ranks' groups had to be merged (``engine/optimizer_groups.py``), the
  record is written again from the merged groups, so that a checkpoint (rank 0's record) holds them whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
from torch.optim import Optimizer


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
