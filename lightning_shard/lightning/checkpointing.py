"""The checkpoint side of ShardStrategy: model and optimizer state in either format (sharded directories or one
full file), saved in the background during fit with ``async_save`` (checkpoint/async_save.py), and what a resumed fit
needs beyond them: the parameters that were trainable when the checkpoint was saved (a fine-tuning callback unfreezes
layers during fit; Lightning restores neither their flags nor, for a strategy that restores after setup, the
callback's param groups in time)."""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_shard.checkpoint import sharded
from lightning_shard.checkpoint.async_save import AsyncSaver
from lightning_shard.checkpoint.export_checkpoint import RECORD, describe_pretrained
from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.fingerprint import check_fingerprints, fingerprints, frozen_names
from lightning_shard.checkpoint.full import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from lightning_shard.checkpoint.io import save_full, save_sharded
from lightning_shard.checkpoint.sharded_source import load_model_source, sharded_source
from lightning_shard.engine.runtime.averaging import AveragedShards
from lightning_shard.engine.runtime.hooks import ShardRuntime
from lightning_shard.lightning.finetuning import readd_finetuning_groups
from lightning_shard.memory.estimate import MemoryEstimate

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class CheckpointState:
    """The checkpoint side of a ShardStrategy (a part of it): what its checkpoint hooks do, each handed the runtime, the
    strategy's optimizers and its options (``state_dict_type``, ``save_frozen``) as they are when called."""

    def __init__(self) -> None:
        self._told_how_to_load = False  # rank 0 said, once, how a sharded checkpoint is read by one process
        self.background: Optional[AsyncSaver] = None  # async_save: the saves written in the background, set at fit

    # -- async_save ---------------------------------------------------------------------------------------------------
    def prepare_background_saves(self, runtime: ShardRuntime, timeout: Optional[timedelta], device: torch.device,
                                 estimate: Optional[MemoryEstimate], callbacks: list) -> None:
        """At a fit's setup: the process group of the background writes (every rank), the step's first agreement
        told of their failures (the engine's ``reducer.background``), and the ``ModelCheckpoint`` callbacks of the
        checkpoints in flight."""
        if self.background is None:
            self.background = AsyncSaver(timeout=timeout, device=device)
        self.background.setup()
        runtime.reducer.background = self.background
        follow_saves_in_flight(callbacks)
        if estimate is not None:  # the first save's host memory, touched ahead of it (checkpoint/staging.py)
            self.background.stager.reserve(estimate.checkpoint_staging, device)

    def saves_in_background(self, trainer: Any) -> bool:
        """During a running fit, until its teardown (Lightning's ``on_fit_end`` comes after it); other saves (after
        it, in validate) are written before they return."""
        return (self.background is not None and self.background.open and trainer is not None
                and trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING)

    def complete_background_saves(self) -> None:
        """Every rank: wait for the save in flight; raise on every rank, naming it, if it failed on any."""
        if self.background is not None:
            self.background.complete()

    def finish_background_saves(self) -> None:
        """A stage's end, every rank: :meth:`complete_background_saves`, then the staging memory (a copy of the rank's
        checkpoint tensors, pinned on a GPU) and the writing thread given back; the next fit's setup takes them
        again."""
        try:
            self.complete_background_saves()
        finally:
            if self.background is not None:
                self.background.close()

    def remove(self, remove: Callable[[], None]) -> None:
        """A checkpoint rotated away (``ModelCheckpoint``'s top-k, its previous ``last``) goes only once the save in
        flight has committed: until then it may be the newest complete one."""
        if self.background is not None:
            self.background.remove_after(remove)
        else:
            remove()

    def note_unfinished_save(self, exception: BaseException, timeout: Optional[timedelta]) -> None:
        """A fit failing (on this rank, or a peer's death seen here): the save in flight ends here first (bounded by
        the process group timeout), and if it did not commit, the error says so, naming it."""
        if self.background is None:
            return
        bound = (timeout.total_seconds() if timeout is not None else 1800.0) + 60.0
        said = self.background.wait_here(timeout=bound)
        if said is not None:
            log.error(said)
            if sys.version_info >= (3, 11):
                exception.add_note(said)

    @staticmethod
    def left_out(runtime: ShardRuntime, optimizers: list[Optimizer], save_frozen: bool) -> set[str]:
        """The parameters a checkpoint leaves out: under ``save_frozen=False`` the frozen ones never trained (every
        rank calls it)."""
        return set() if save_frozen else frozen_names(runtime, optimizers)

    def record(self, runtime: ShardRuntime, optimizers: list[Optimizer], save_frozen: bool) -> dict[str, Any]:
        """What a resume and ``python -m lightning_shard.export`` need beyond the tensors (every rank calls it)."""
        left_out = self.left_out(runtime, optimizers, save_frozen)
        return {"trainable": [name for name, p in runtime.root.named_parameters() if p.requires_grad],
                "pretrained": describe_pretrained(runtime.root),
                # the frozen parameters left out, each a fingerprint to check the base a resume starts from
                "left_out": sorted(left_out), "fingerprints": fingerprints(runtime, left_out)}

    def module_state(self, runtime: ShardRuntime, optimizers: list[Optimizer], state_dict_type: str,
                     save_frozen: bool) -> dict[str, Any]:
        """Sharded: this rank's shards (views, for DCP). Full: the unsharded state dict on rank 0 ({} elsewhere)."""
        for optimizer in optimizers:  # the first thing a checkpoint asks: the groups agreed (and a fine-tuning
            runtime.optimizers.agree_on_groups(optimizer)  # callback's record of them) before the rest is saved
        if state_dict_type == "sharded":  # what the module's own state_dict() leaves out, left out too
            return _without(sharded.model_state(runtime, skip=self.left_out(runtime, optimizers, save_frozen)),
                            sharded.left_out_by_module(runtime))
        return full_state_dict(runtime, rank0_only=True, skip=self.left_out(runtime, optimizers, save_frozen))

    @staticmethod
    def check_module_state_dict(runtime: Optional[ShardRuntime], state_dict_type: str) -> None:
        """At a fit's setup: a ``state_dict`` override that sharded checkpoints cannot honour (it adds or renames keys)
        is refused then, not at the first save."""
        if state_dict_type == "sharded" and runtime is not None:
            sharded.left_out_by_module(runtime)

    def averaged_state(self, runtime: ShardRuntime, optimizers: list[Optimizer], average: AveragedShards,
                       state_dict_type: str, save_frozen: bool) -> dict[str, Any]:
        """:meth:`module_state` of an average of the model's weights (``ShardedWeightAveraging``)."""
        if state_dict_type == "sharded":
            return _without(sharded.model_state(runtime, skip=self.left_out(runtime, optimizers, save_frozen),
                                                average=average), sharded.left_out_by_module(runtime))
        with average.swapped():  # copied before the swap back: on the CPU the buffers in it are the model's own
            state = full_state_dict(runtime, rank0_only=True, skip=self.left_out(runtime, optimizers, save_frozen))
            return {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}

    @staticmethod
    def optimizer_state(runtime: ShardRuntime, optimizer: Optimizer, state_dict_type: str) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if state_dict_type == "sharded":
            return sharded.optimizer_state(runtime, optimizer)
        return full_optimizer_state_dict(runtime, optimizer, rank0_only=True)

    def save(self, checkpoint: dict[str, Any], path: Path, storage_options: Optional[Any], state_dict_type: str,
             is_global_zero: bool, checkpoint_io: Any, trainer: Any) -> None:
        """Written beside the target and moved into place when complete (``path``: the same on every rank); during a
        fit under ``async_save``, staged and written while training goes on."""
        if state_dict_type == "sharded":
            if storage_options is not None:
                raise TypeError("`storage_options` is not supported with state_dict_type='sharded'.")
            if self.saves_in_background(trainer):
                assert self.background is not None
                self.background.save(checkpoint, path)  # staged; written while training goes on
            else:
                self.complete_background_saves()
                save_sharded(checkpoint, path, group=None)
            if not self._told_how_to_load:
                self._told_how_to_load = True
                rank_zero_info(f"lightning_shard: checkpoints are sharded directories (one file per rank, resumable"
                               f" on any number of ranks). For one process, `python -m lightning_shard.consolidate"
                               f" {shlex.quote(str(path))}` (the one just written, or any later one: your"
                               f" ModelCheckpoint's best_model_path) writes one file for"
                               f" `YourLightningModule.load_from_checkpoint(...)`; or"
                               f" `ShardStrategy(state_dict_type='full')`.")
        elif is_global_zero:
            save_full(checkpoint, path, checkpoint_io, storage_options)

    @staticmethod
    def load_model_state(runtime: ShardRuntime, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """What the checkpoint holds; the frozen parameters it left out (``save_frozen=False``) stay as loaded
        before (the base, from ``load_pretrained``), checked against their fingerprints."""
        record = checkpoint.get(RECORD, {})
        left_out = set(record.get("left_out", ()))
        source = sharded_source(checkpoint["state_dict"])  # (renamed or pruned by on_load_checkpoint, maybe)
        if source is not None:
            load_model_source(runtime, source, strict=strict, absent=left_out)
        else:
            load_full_state_dict(runtime, checkpoint["state_dict"], strict=strict, absent=left_out)
        if record.get("fingerprints"):
            where = source.directory if source is not None else "the checkpoint file"
            check_fingerprints(runtime, record["fingerprints"], str(where))

    @staticmethod
    def load_optimizer_states(runtime: ShardRuntime, optimizers: list[Optimizer], checkpoint: Mapping[str, Any],
                              trainer: Any) -> None:
        """Resuming a fit: the parameters trainable when it was saved, the fine-tuning callbacks' param groups,
        then the optimizer states."""
        _restore_trainable(runtime, checkpoint.get(RECORD, {}).get("trainable"))
        if trainer is not None:
            readd_finetuning_groups(trainer)
        source, states = sharded_source(checkpoint["state_dict"]), checkpoint["optimizer_states"]
        if len(states) != len(optimizers):  # zip() would leave some optimizer as it was built
            raise CheckpointError(
                f"The checkpoint holds {len(states)} optimizer state(s) and `configure_optimizers` returns"
                f" {len(optimizers)} optimizer(s): resume with the optimizers it was saved with, or load its"
                " weights only (`load_pretrained`, or the LightningModule's `load_state_dict`) and start the"
                " optimizers afresh.")
        for i, (optimizer, state) in enumerate(zip(optimizers, states)):
            if source is not None:
                sharded.load_optimizer_state(runtime, optimizer, i, state, source.directory, source.metadata)
            else:
                load_full_optimizer_state_dict(runtime, optimizer, state)


def follow_saves_in_flight(callbacks: list) -> None:
    """``ModelCheckpoint`` decides from what is on disk, where a checkpoint written in the background is not yet: its
    version counter (a file name used again gets ``-v1``) takes the checkpoint in flight for one that exists, and
    ``save_last="link"`` links ``last`` to it once it is complete (rank 0, after its commit; never if it fails:
    ``last`` stays on the newest complete one). Once per callback; the Trainer's strategy looked up at each call."""
    for callback in callbacks:
        if not isinstance(callback, ModelCheckpoint) or getattr(callback, "_follows_saves_in_flight", False):
            continue
        callback._follows_saves_in_flight = True
        exists, link = callback.file_exists, callback._link_checkpoint

        def file_exists(filepath: Any, trainer: "pl.Trainer", exists: Any = exists) -> bool:
            background = _background_of(trainer)
            return exists(filepath, trainer) or (background is not None and background.writing(filepath))

        def link_checkpoint(trainer: "pl.Trainer", filepath: str, linkpath: str, link: Any = link) -> None:
            background = _background_of(trainer)
            if background is None or not background.writing(filepath):
                return link(trainer, filepath, linkpath)
            if trainer.is_global_zero:  # Lightning's own link, from the writing thread: rank 0's part, no barrier
                alone = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda *_: None))
                background.remove_after(partial(link, alone, filepath, linkpath))
            trainer.strategy.barrier()

        callback.file_exists, callback._link_checkpoint = file_exists, link_checkpoint


def _background_of(trainer: "pl.Trainer") -> Optional[AsyncSaver]:
    checkpoints = getattr(trainer.strategy, "checkpoints", None)  # (another strategy on the same callback later)
    return checkpoints.background if isinstance(checkpoints, CheckpointState) else None


def _without(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in names}


def _restore_trainable(runtime: ShardRuntime, trainable: Optional[list[str]]) -> None:
    """``requires_grad`` as when the checkpoint was saved (a fine-tuning callback's ``freeze_before_training`` at
    setup freezes what it unfroze during fit; Lightning's own resume leaves it frozen). Checkpoints without the
    record (saved by another strategy) leave the flags alone."""
    if trainable is None:
        return
    wanted = set(trainable)
    changed = [(name, p) for name, p in runtime.root.named_parameters() if p.requires_grad != (name in wanted)]
    for name, param in changed:
        param.requires_grad_(name in wanted)
    if changed:
        thawed = [name for name, p in changed if p.requires_grad]
        frozen = [name for name, p in changed if not p.requires_grad]
        rank_zero_info(f"lightning_shard: trainable parameters as when the checkpoint was saved: {len(thawed)}"
                       f" trainable again {thawed[:3]}, {len(frozen)} frozen again {frozen[:3]}.")
