"""The checkpoint side of ShardStrategy as Lightning asks for it: a strategy whose model, once set up, is a sharded
``runtime``, and whose checkpoint hooks (save, load, remove, the model's and optimizers' state) hand its
``checkpoints`` part (checkpointing.py) what each needs, with the checkpoint options (``state_dict_type``,
``save_frozen``, ``async_save``). ShardStrategy builds on it and shards the model; this knows nothing of steps."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

from torch.optim import Optimizer

from lightning_shard.checkpoint.export import save_pretrained
from lightning_shard.checkpoint.export_checkpoint import RECORD
from lightning_shard.checkpoint.io import open_checkpoint, validate_async_save, validate_state_dict_type
from lightning_shard.engine.runtime.averaging import AveragedShards
from lightning_shard.engine.runtime.hooks import ShardRuntime
from lightning_shard.lightning.checkpointing import CheckpointState
from lightning_shard.lightning.options import check_flag
from lightning_shard.lightning.process_strategy import ProcessGroupStrategy


class CheckpointingStrategy(ProcessGroupStrategy):
    """A ProcessGroupStrategy that checkpoints its ``runtime`` (set by the subclass once the model is sharded)."""

    def __init__(self, state_dict_type: str = "sharded", save_frozen: bool = True, async_save: bool = False,
                 **process_options: Any) -> None:
        super().__init__(**process_options)
        self.state_dict_type = validate_state_dict_type(state_dict_type)
        self.save_frozen = check_flag("save_frozen", save_frozen)
        self.async_save = validate_async_save(async_save, self.state_dict_type)
        self.checkpoints = CheckpointState()
        self.runtime: Optional[ShardRuntime] = None

    @property
    def restore_checkpoint_after_setup(self) -> bool:  # load into the sharded model
        return True

    def _sharded_now(self) -> bool:
        """Whether this stage's model is sharded: not yet where its setup failed before sharding it (in the module's
        ``setup`` hook, ``configure_model``, a refused option), when OnExceptionCheckpoint saves it; there it is whole
        on every rank, as DDP's, and an earlier fit's runtime (the Trainer's) is another model's."""
        return self.runtime is not None and self.runtime.root is self.model

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._sharded_now():  # whole, as DDP's: the module's own state dict
            return super().lightning_module_state_dict()
        return self.checkpoints.module_state(self.runtime, self.optimizers, self.state_dict_type, self.save_frozen)

    def averaged_state_dict(self, average: AveragedShards) -> dict[str, Any]:  # (ShardedWeightAveraging's)
        assert self.runtime is not None
        return self.checkpoints.averaged_state(self.runtime, self.optimizers, average, self.state_dict_type,
                                               self.save_frozen)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.runtime is not None
        return self.checkpoints.optimizer_state(self.runtime, optimizer, self.state_dict_type)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Written beside the target and moved into place when complete: a save that fails or is killed
        half-way leaves the previous checkpoint intact, and a partial one never carries its name."""
        path = Path(self.broadcast(os.fspath(filepath)))
        sharded = self._sharded_now()  # (not yet sharded: the whole model, one full file written by rank 0, as DDP's)
        if sharded:
            checkpoint[RECORD] = self.checkpoints.record(self.runtime, self.optimizers, self.save_frozen)
        elif self.optimizers:  # an earlier fit's, of another model's shards: this model has none yet
            checkpoint["optimizer_states"], checkpoint["lr_schedulers"] = [], []
        trainer = getattr(self.lightning_module, "_trainer", None)
        self.checkpoints.save(checkpoint, path, storage_options, self.state_dict_type if sharded else "full",
                              self.is_global_zero, self.checkpoint_io, trainer)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Under ``async_save``, once the save in flight has committed (until then this may be the newest complete
        checkpoint)."""
        self.checkpoints.remove(partial(super().remove_checkpoint, filepath))

    def complete_background_saves(self) -> None:
        """``async_save``, every rank: wait for the save in flight; raise on every rank, naming it, if it failed."""
        self.checkpoints.complete_background_saves()

    def save_pretrained(self, folder: Union[str, Path], **options: Any) -> Path:
        """The trained model as a Hugging Face folder that ``from_pretrained`` loads (a peft model: its adapter,
        or ``merged=True``); options as ``lightning_shard.checkpoint.export.save_pretrained``'s (``dtype``,
        ``max_shard_size``, ``merged``, ``prefix``, ``adapter``). Every rank must call it; rank 0 writes."""
        assert self.lightning_module is not None, "save_pretrained before the model is set up"
        return save_pretrained(self.lightning_module, self.broadcast(os.fspath(folder)), **options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Either format, saved on any number of ranks; checked first, read with ``weights_only=True``."""
        path = Path(self.broadcast(os.fspath(checkpoint_path)))
        self.checkpoints.complete_background_saves()  # (one being written may be the one asked for)
        return open_checkpoint(path)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.runtime is not None
        self.checkpoints.load_model_state(self.runtime, checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.runtime is not None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self.checkpoints.load_optimizer_states(self.runtime, self.optimizers, checkpoint, trainer)
