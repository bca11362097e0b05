"""``ShardedWeightAveraging``: Lightning's ``WeightAveraging`` (SWA, or any ``AveragedModel`` average) for a model sharded
by ShardStrategy; ``ShardedEMA`` (ema.py) is its ``EMAWeightAveraging``.

Lightning's callback deep-copies the whole LightningModule before the strategy shards it and averages its
parameters into the copy; this one keeps the average as sharded as the model (engine/runtime/averaging.py: 1/N of the
weights per rank, beside the master shards, on the host when they are offloaded). Everything else is Lightning's:
the same options and ``should_update``, the average swapped in for validation and into the model when training
ends, and the same checkpoint layout (the average as ``state_dict``, so ``load_from_checkpoint`` and
``python -m lightning_shard.export`` give it; the weights trained as ``current_model_state``, which a resumed fit
goes on from), in either of the strategy's formats. Swapped, not copied, at the end: a checkpoint written after
(``ModelCheckpoint``'s last) keeps the weights trained, where Lightning's callback has overwritten them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_shard.checkpoint.io import CURRENT
from lightning_shard.engine.runtime.averaging import AveragedShards, AverageUpdate, averaged_model_update
from lightning_shard.engine.runtime.hooks import ShardRuntime

AVERAGING_STATE = "averaging_state"  # Lightning's key for the averaged model's other state (``n_averaged``)


class ShardedWeightAveraging(Callback):
    """An average of the weights, updated after optimizer steps: by default their equal average (SWA), or what
    ``avg_fn`` / ``multi_avg_fn`` compute, as for torch's ``AveragedModel`` (elementwise: each rank averages its
    1-D shards). Override :meth:`should_update` to say when (by default after every optimizer step);
    ``use_buffers`` averages the buffers too (else the average takes the model's); ``device`` keeps the average
    elsewhere (``"cpu"``: in host memory, copied there at each update)."""

    _lightning_name = "WeightAveraging"  # the callback to use instead under another strategy

    def __init__(self, device: Optional[Union[str, torch.device]] = None, use_buffers: bool = True,
                 avg_fn: Optional[Callable] = None, multi_avg_fn: Optional[Callable] = None) -> None:
        if not isinstance(use_buffers, bool):
            raise ValueError(f"{type(self).__name__}: `use_buffers` must be True or False; got {use_buffers!r}.")
        for name, value in (("avg_fn", avg_fn), ("multi_avg_fn", multi_avg_fn)):
            if value is not None and not callable(value):
                raise ValueError(f"{type(self).__name__}: `{name}` must be a function or None; got {value!r}.")
        self.use_buffers = use_buffers
        self.device = torch.device(device) if device is not None else None  # a bad name fails here, not at fit
        self._averaging = averaged_model_update(avg_fn, multi_avg_fn)
        self.average: Optional[AveragedShards] = None  # during fit
        self._ended = False
        self._latest_update_step = 0  # optimizer steps taken at the last update (the first: after the first step)
        self._latest_update_epoch = -1

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """After each optimizer step (``step_idx``, zero-based) and each training epoch (``epoch_idx``): update now?"""
        return step_idx is not None

    def _update_function(self) -> AverageUpdate:
        return self._averaging

    def estimated_bytes(self, runtime: ShardRuntime, device: torch.device) -> tuple[int, int]:
        """Bytes the average will hold per rank, (on the device, in host memory): a copy of this rank's master shards
        and of the buffers, where it keeps them (by default beside each shard: in host memory when offloaded). Read
        by the strategy's memory report at setup."""
        on_device = in_host = 0
        for tensor in [unit.storage.shard for unit in runtime.units] + list(runtime.root.buffers()):
            nbytes = tensor.numel() * tensor.element_size()
            if (self.device or tensor.device).type == "cpu" and device.type != "cpu":
                in_host += nbytes
            else:
                on_device += nbytes
        return on_device, in_host

    # -- fit ----------------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        from lightning_shard.lightning.strategy import ShardStrategy

        if not isinstance(trainer.strategy, ShardStrategy):
            raise TypeError(f"{type(self).__name__} averages the shards of ShardStrategy; under"
                            f" {type(trainer.strategy).__name__} use Lightning's {self._lightning_name}.")

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        runtime = trainer.strategy.runtime
        lower = sorted({str(u.storage.master_dtype) for u in runtime.units
                        if u.storage.master_dtype.is_floating_point and u.storage.master_dtype.itemsize < 4})
        if lower:  # Lightning's average copies the module before its precision converts it: fp32
            raise ValueError(
                f"{type(self).__name__}: the master weights are {', '.join(lower)} (precision='bf16-true' or"
                " '16-true'), so an average kept beside them would be too, where an update's share of the weights"
                " (an EMA's (1 - decay) * weights) falls below half a unit in the last place and the average barely"
                " moves (Lightning's average is fp32). Train with precision='bf16-mixed' (fp32 masters) to average"
                " the weights; an fp32 average of low-precision masters is not built yet.")
        self.average = AveragedShards(runtime, self._update_function(), self.use_buffers, self.device)
        self._ended = False  # training ended: the model holds the average, and ``average`` the weights trained

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=trainer.global_step - 1):
            self._update()
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self._update()
            self._latest_update_epoch = trainer.current_epoch

    def _update(self) -> None:
        assert self.average is not None, f"{type(self).__name__}: an update outside fit"
        self.average.update()

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # swapped, not copied: a checkpoint saved after this (ModelCheckpoint's last, at the end of training) still
        # holds the weights trained, which a fit resumed from it goes on from (Lightning's callback saves the average
        # as both there)
        self._end()

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._end()  # a fit with nothing left to train (resumed at its last step) runs no on_train_end

    def _end(self) -> None:
        if self.average is not None and not self._ended:
            self.average.swap()
            self._ended = True

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self.average = None  # its memory back: the model holds the average now

    # Swapped at the start and end of validation (Lightning's callback: of its epoch), before the strategy's own hooks:
    # keep_gathered_in_eval gathers the units, and makes the ranks' buffers rank 0's, when validation starts.
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.average is not None:
            self.average.swap()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.average is not None:
            self.average.swap()

    # -- checkpoints (Lightning's layout) -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        if self.average is None:
            rank_zero_info(f"{type(self).__name__}: a checkpoint saved outside fit holds no average (after fit the model's"
                           " weights are the average).")
            return
        held = trainer.strategy.averaged_state_dict(self.average)
        if self._ended:  # the model holds the average, and ``average`` the weights trained
            checkpoint[CURRENT] = held
        else:
            checkpoint[CURRENT], checkpoint["state_dict"] = checkpoint["state_dict"], held
        checkpoint[AVERAGING_STATE] = {"n_averaged": torch.tensor(self.average.n_averaged, dtype=torch.long)}

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        if self.average is None:
            rank_zero_warn(f"{type(self).__name__}: a checkpoint loaded outside fit: its average is not restored (the model holds"
                           " the checkpoint's state_dict, which is the average where it has one).")
            return
        self.average.copy_from_model()  # the model was just loaded from state_dict: the average, where there is one
        if CURRENT in checkpoint and AVERAGING_STATE in checkpoint:
            trainer.strategy.load_model_state_dict({**checkpoint, "state_dict": checkpoint[CURRENT]},
                                                   strict=pl_module.strict_loading)
            self.average.n_averaged = int(checkpoint[AVERAGING_STATE]["n_averaged"])
        else:
            rank_zero_warn(f"{type(self).__name__}: the checkpoint holds no average; it begins from the weights loaded.")
