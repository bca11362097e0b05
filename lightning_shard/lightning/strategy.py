"""ShardStrategy: the Lightning face of the engine (process group, sharding at setup, steps,
optimizer and precision hooks, checkpoint state)."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_shard.engine.comm.groups import validate_shard_size, validate_sharding
from lightning_shard.engine.optim.optimizer_step import DEFAULT_STEP_GROUP_NUMEL
from lightning_shard.engine.optim.optimizers import WHOLE, optimizer_kind
from lightning_shard.engine.plan.plan import UnitSpec, validate_min_unit_size, validate_unit_size, validate_units
from lightning_shard.engine.runtime.activation_checkpointing import CheckpointSpec, validate_activation_checkpointing
from lightning_shard.engine.runtime.compile import refuse_with_elision, validate_compile
from lightning_shard.engine.storage.offload import validate_offload
from lightning_shard.lightning.after_step import after_step
from lightning_shard.lightning.at_setup import prepare_fit, refuse_callbacks, shard_model
from lightning_shard.lightning.checkpoint_strategy import CheckpointingStrategy
from lightning_shard.lightning.evaluation import EvaluationHold
from lightning_shard.lightning.finetuning import record_merged_groups
from lightning_shard.lightning.guards import refuse_other_strategies
from lightning_shard.lightning.offload_overlap import arm_for_step
from lightning_shard.lightning.options import (check_count, check_declared_optimizers, check_flag, check_nonfinite,
                                               check_units_or_size)
from lightning_shard.lightning.precision import (MixedPrecision, ShardPrecision, shard_precision_of,
                                                 validate_mixed_precision)
from lightning_shard.memory.estimate import MemoryEstimate


class ShardStrategy(CheckpointingStrategy):
    """Fully sharded data parallel training, implemented on ``torch.distributed`` collectives. Every option, with
    what it costs and what it changes, is in docs/options.md; in short:

    Args:
        sharding: ``"full"`` (ZeRO-3), ``"grad_op"`` (ZeRO-2: parameters kept gathered from forward to backward),
            ``"hybrid"`` (``full`` within groups of ``shard_size`` ranks, replicated across them) or ``"none"``.
        shard_size: ranks per shard group under ``"hybrid"`` (default: the devices per node).
        units: module classes, or class names, whose every instance becomes one unit.
        unit_size: a parameter budget: consecutive submodules packed into units of at most this many parameters.
            With neither, each instance of a repeated block class is a unit.
        min_unit_size: consecutive sibling units with fewer parameters than this are merged into one.
        prefetch: how many units ahead to all-gather while the current one computes (0: off).
        activation_checkpointing: ``True``, or module classes or names: recompute their activations in backward.
        elide_backward_gathers: skip the backward all-gather of a unit whose parameters autograd did not save.
        broadcast_buffers: rank 0's buffers broadcast before a step that follows a training step, as DDP's.
        reduce_during_accumulation: reduce-scatter after every micro-batch (gradients stay 1/N); ``False`` only
            after the last one (less communication, a full gradient per unit held).
        free_grads_after_step: free the gradient shards right after each optimizer step (the same numbers).
        mixed_precision: dtypes of gathers and compute, gradient reduction and buffers; wins over ``precision``.
        nonfinite: ``None``, ``"skip"`` (a step with a non-finite gradient on any rank skipped on every rank) or
            ``"error"``; checked before each optimizer step, on the gradients accumulated for it.
        state_dict_type: ``"sharded"`` (each rank writes its shards into a checkpoint directory) or ``"full"``
            (rank 0 writes one ordinary file); either loads on any number of ranks.
        save_frozen: ``False`` leaves frozen parameters out of checkpoints, fingerprinted.
        async_save: a sharded save during fit copies the state to host memory and returns; the files are written in
            the background while training goes on (the same checkpoint, crash-safe; one save in flight at a time).
        offload: ``"optimizer"`` (master weights, gradients and optimizer state in host memory, stepped by the
            CPU) or ``"params"`` (also no shard on the device between steps); the same numbers as without.
        offload_overlap: with ``offload``, the CPU steps each unit as its gradient lands, during backward, where
            no hook of yours runs between backward and step (the same numbers); ``False``: after the backward.
        elementwise_optimizers, matrix_optimizers: your own optimizer classes, stepped on 1-D shards, or whole
            on owner ranks; an optimizer neither known nor declared is refused at setup.
        step_group_size: parameter elements per rank one optimizer step updates at once.
        keep_gathered_in_eval: evaluation loops hold every unit gathered (one all-gather per unit per loop).
        compile: ``True``, or ``torch.compile``'s keyword arguments: each unit's blocks compiled.
        timeout: bound on every collective (a ``timedelta`` or seconds).

    ``configure_model()`` and ``trainer.init_module(empty_init=True)`` build the model on the meta device;
    setup materialises it unit by unit (each module's ``reset_parameters()``), keeping only this rank's shards.

    Its parts: ``processes`` (process_group.py) and ``checkpoints`` (checkpointing.py), held by its bases
    (process_strategy.py, checkpoint_strategy.py: their Lightning hooks), ``evaluation`` (evaluation.py) and, once the
    model is sharded, ``runtime`` (the engine's); Lightning's hooks here hand each what it needs.
    """

    strategy_name = "lightning_shard"

    def __init__(
        self,
        sharding: str = "full",
        shard_size: Optional[int] = None,
        units: Optional[Union[UnitSpec, Sequence[UnitSpec]]] = None,
        unit_size: Optional[int] = None,
        min_unit_size: Optional[int] = None,
        prefetch: int = 1,
        activation_checkpointing: CheckpointSpec = False,
        elide_backward_gathers: bool = False,
        broadcast_buffers: bool = True,
        reduce_during_accumulation: bool = True,
        free_grads_after_step: bool = True,
        mixed_precision: Optional[MixedPrecision] = None,
        nonfinite: Optional[str] = None,
        state_dict_type: str = "sharded",
        save_frozen: bool = True,
        async_save: bool = False,
        offload: Optional[str] = None,
        offload_overlap: bool = True,
        elementwise_optimizers: Sequence[type] = (),
        matrix_optimizers: Sequence[type] = (),
        step_group_size: int = DEFAULT_STEP_GROUP_NUMEL,
        keep_gathered_in_eval: bool = False,
        compile: Union[bool, dict[str, Any]] = False,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
    ) -> None:
        super().__init__(state_dict_type=state_dict_type, save_frozen=save_frozen, async_save=async_save,
                         accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.sharding = validate_sharding(sharding)
        self.shard_size = validate_shard_size(shard_size, sharding)
        self.units = validate_units(units)
        self.unit_size = validate_unit_size(unit_size)
        check_units_or_size(self.units, self.unit_size)
        self.min_unit_size = validate_min_unit_size(min_unit_size, self.unit_size)
        self.prefetch = check_count("prefetch", prefetch, 0, "units gathered ahead")
        self.activation_checkpointing = validate_activation_checkpointing(activation_checkpointing)
        self.elide_backward_gathers = check_flag("elide_backward_gathers", elide_backward_gathers)
        self.broadcast_buffers = check_flag("broadcast_buffers", broadcast_buffers)
        self.reduce_during_accumulation = check_flag("reduce_during_accumulation", reduce_during_accumulation)
        self.free_grads_after_step = check_flag("free_grads_after_step", free_grads_after_step)
        self.frees_grads_after_step = False  # decided at setup (after_step.py)
        self.mixed_precision = validate_mixed_precision(mixed_precision)
        self.nonfinite = check_nonfinite(nonfinite)
        self.offload = validate_offload(offload)
        self.offload_overlap = check_flag("offload_overlap", offload_overlap)
        self.offload_overlap_clip: Optional[tuple[Optional[float]]] = None  # decided at setup (offload_overlap.py)
        self._stepping: Optional[Optimizer] = None  # inside Lightning's optimizer step: its last micro-batch runs
        self.elementwise_optimizers, self.matrix_optimizers = check_declared_optimizers(elementwise_optimizers,
                                                                                        matrix_optimizers)
        self.step_group_size = check_count("step_group_size", step_group_size, 1,
                                           "parameter elements per rank stepped at once")
        self.keep_gathered_in_eval = check_flag("keep_gathered_in_eval", keep_gathered_in_eval)
        self.compile = validate_compile(compile)
        refuse_with_elision(self.compile, self.elide_backward_gathers)
        self.evaluation = EvaluationHold()
        self.told_shard_norms = False  # the warning about Lightning's grad_norm of the shards was given (after_step.py)
        self.memory_estimate: Optional[MemoryEstimate] = None  # per rank, set at setup for fitting

    # -- properties Lightning asks for --------------------------------------------------------------
    @property
    def precision_plugin(self) -> ShardPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ShardPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = shard_precision_of(plugin)

    @property
    def comm_stats(self) -> dict[str, float]:
        """Communication of the last optimizer step: bytes all-gathered, reduce-scattered and all-reduced,
        the number of collectives, and the seconds compute spent blocked on them (exposed communication)."""
        return dict(self.runtime.last_step_stats) if self.runtime is not None else {}

    # -- setup --------------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_callbacks(trainer)
        if self.runtime is None or self.runtime.root is not self.model:
            shard_model(self, self._layer_sync)  # (sets self.runtime)
        self.runtime.apply_checks = [partial(refuse_other_strategies, self.model, ShardStrategy)]
        if self.keep_gathered_in_eval:
            rank_zero_info(f"lightning_shard: keep_gathered_in_eval holds every unit gathered during validation, test"
                           f" and predict loops: {self.runtime.held_bytes() / 2**20:.1f} MiB more per rank while they run.")
        self.precision_plugin.runtime = self.runtime
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            if self.offload is None:  # offloaded, the state lives beside the host shards (Adagrad builds it at setup)
                _optimizers_to_device(self.optimizers, self.root_device)
            prepare_fit(self, trainer)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """``configure_optimizers`` sees the parameters in their real shapes (placeholders: ``p.ndim`` rules for
        weight decay or for Muon work as without sharding); each optimizer then gets the shard parameters and
        its sharded step."""
        assert self.runtime is not None
        self._reset_optimizers_and_schedulers()  # references to parameters of an earlier setup are stale
        with self.runtime.shaped_parameters():
            super().setup_optimizers(trainer)
        for index, optimizer in enumerate(self.optimizers):
            optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if not isinstance(optimizer, _MockOptimizer):  # configure_optimizers returned None
                kind = optimizer_kind(optimizer, self.elementwise_optimizers, self.matrix_optimizers)
                step = self.runtime.attach_optimizer(optimizer, whole=kind == WHOLE, step_group_numel=self.step_group_size)
                # a fine-tuning callback's record of the groups follows when the ranks' groups are merged
                step.on_merge = partial(record_merged_groups, trainer, index, optimizer, step.names)

    def model_to_device(self) -> None:
        assert self.model is not None
        if self.runtime is None:  # moving a sharded model would break its shard views
            # meta tensors stay: setup materialises them on the device unit by unit
            self.model._apply(lambda t: t if t.is_meta else t.to(self.root_device))

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device: setup materialises only this rank's shards."""
        with torch.device("meta"):
            yield

    # -- steps --------------------------------------------------------------------------------------
    def _run_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        assert self.runtime is not None
        return self.runtime.run_step(step, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step(super().training_step, *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        # armed at the loss's backward, not as the training step begins: what the step did before (a learning rate
        # set, a gradient penalty's own backward) is what the serial step would see too
        arm_for_step(self, self._stepping)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step(super().predict_step, *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation."""
        if self.runtime is None:
            yield
        elif self.reduce_during_accumulation:  # reduce-scatters as usual, the all-reduce across replicas once
            with self.runtime.no_replica_sync():
                yield
        else:
            with self.runtime.no_sync():
                yield

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        assert self.runtime is not None
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        self._stepping = inner if self.lightning_module.automatic_optimization else None
        try:
            with self.runtime.optimizers.stepping(inner):  # the step Lightning (or its gradient scaler) calls
                output = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._stepping = None
        self.runtime.after_optimizer_step()
        after_step(self, inner)
        return output

    # -- gradient norms: every rank must call these (one all-reduce) ------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        parameters: Optional[Iterable[Tensor]] = None) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the sharded model (all its parameters unless ``parameters``):
        the norm over every rank's shards, so the same clipping as on the unsharded model; returns that norm.
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would see this rank's shards only."""
        assert self.runtime is not None, "clip_grad_norm_ before the model is sharded"
        params = self.runtime.root.parameters() if parameters is None else parameters
        return self.runtime.clip_grad_norm_(list(params), float(max_norm), norm_type)

    def grad_norm(self, norm_type: Union[float, int, str] = 2.0, group_separator: str = "/") -> dict[str, Tensor]:
        """Lightning's ``grad_norm(model, norm_type)`` for the sharded model (its keys, the unsharded model's
        numbers): each parameter's gradient norm over every rank's shards and their total."""
        assert self.runtime is not None, "grad_norm before the model is sharded"
        norm_type = float(norm_type)
        names, each, total = self.runtime.grad_norms(norm_type)
        result = {f"grad_{norm_type}_norm{group_separator}{name}": value for name, value in zip(names, each)}
        if names:
            result[f"grad_{norm_type}_norm_total"] = total
        return result

    # -- a stage's end (process_group.py) ------------------------------------------------------------
    def teardown(self) -> None:
        # Unlike the base class, do not move the module to CPU: that would break its shard views.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.processes.end_stage(self.runtime, self.lightning_module, self.barrier,
                                 self.checkpoints.finish_background_saves)
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- evaluation loops with every unit held gathered (evaluation.py) ------------------------------
    @contextmanager
    def keep_gathered(self, modifier_rank: Optional[int] = None) -> Generator[None, None, None]:
        """Every unit held gathered inside (every rank must enter): forwards without gradients run no collective,
        so evaluation or generation needs one all-gather per unit in all, and ranks may generate different numbers
        of tokens. Costs ``strategy.runtime.held_bytes()`` per rank while it lasts. Writes to the parameters inside
        are written back from ``modifier_rank`` on exit, and refused without it (engine/runtime/held.py)."""
        assert self.runtime is not None, "keep_gathered before the model is sharded"
        with self.runtime.keep_gathered(modifier_rank):
            yield

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.evaluation.hold(self.runtime, self.keep_gathered_in_eval)

    def on_validation_end(self) -> None:
        self.evaluation.release()
        super().on_validation_end()

    def on_test_start(self) -> None:
        super().on_test_start()
        self.evaluation.hold(self.runtime, self.keep_gathered_in_eval)

    def on_test_end(self) -> None:
        self.evaluation.release()
        super().on_test_end()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.evaluation.hold(self.runtime, self.keep_gathered_in_eval)

    def on_predict_end(self) -> None:
        self.evaluation.release()
        super().on_predict_end()

    def on_exception(self, exception: BaseException) -> None:
        self.evaluation.release(exception)
        self.checkpoints.note_unfinished_save(exception, self.processes.timeout)
        super().on_exception(exception)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, sharding in (
            ("lightning_shard", "full"),
            ("lightning_shard_grad_op", "grad_op"),
            ("lightning_shard_hybrid", "hybrid"),  # shard groups of a node's devices, replicated across nodes
            ("lightning_shard_no_shard", "none"),
        ):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"lightning_shard, sharding={sharding!r}",
                                           sharding=sharding)


