"""What ShardStrategy's setup does besides Lightning's own: the model sharded with the strategy's options (peft's
adapters and DoRA's magnitudes initialised as peft would on a model built on the meta device, a ``from_pretrained``
model's folders loaded, the plan logged), and a fit prepared (what callbacks and options ask of it, checked and
decided once, from the code every rank runs)."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info

from lightning_shard.checkpoint.from_pretrained import built
from lightning_shard.checkpoint.peft_meta import (
    forget_placeholders,
    init_dora_magnitudes,
    init_peft_adapters,
    prepare_dora_on_meta,
)
from lightning_shard.checkpoint.pretrained import load_pretrained
from lightning_shard.engine.shard_module import shard_module
from lightning_shard.lightning.after_step import frees_grads_after_step
from lightning_shard.lightning.guards import refuse_layer_sync_on_sharded, refuse_pruning, refuse_weight_averaging
from lightning_shard.lightning.memory_report import report_memory_estimate
from lightning_shard.lightning.offload_overlap import overlap_clip, restage_each_step
from lightning_shard.lightning.plan_summary import plan_listing, plan_summary
from lightning_shard.lightning.summary import summarize_in_full_shapes


def shard_model(strategy: Any, layer_sync: Optional[LayerSync]) -> None:
    """``strategy.model`` converted, on its device, and sharded with ``strategy``'s options, its ``runtime`` set as soon
    as it is built (what follows may raise: the model is sharded all the same), then initialised and loaded (every
    rank calls it). A model sharded by an earlier Trainer goes on with its runtime if the options are the same
    (shard_module checks them); on it, convert_module and model_to_device may only be no-ops (its `_apply` refuses
    more)."""
    sharded_before = getattr(strategy.model, "_shard_runtime", None) is not None
    if layer_sync:  # (the Trainer's sync_batchnorm) also for validate/test before fit: the model is sharded once
        if sharded_before:
            refuse_layer_sync_on_sharded(strategy.model)
        else:
            strategy.model = layer_sync.apply(strategy.model)
    strategy.model = strategy.precision_plugin.convert_module(strategy.model)
    strategy.model_to_device()
    model = strategy.model
    policy = strategy.mixed_precision or strategy.precision_plugin.policy
    from_meta = any(p.is_meta for p in model.parameters())
    placeholders = prepare_dora_on_meta(model) if from_meta else []
    strategy.runtime = runtime = shard_module(
        model, sharding=strategy.sharding, units=strategy.units, unit_size=strategy.unit_size,
        min_unit_size=strategy.min_unit_size, prefetch=strategy.prefetch,
        param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype, buffer_dtype=policy.buffer_dtype,
        cast_params=policy.cast_params,
        nonfinite=strategy.nonfinite, device=strategy.root_device,
        activation_checkpointing=strategy.activation_checkpointing,
        elide_backward_gathers=strategy.elide_backward_gathers, broadcast_buffers=strategy.broadcast_buffers,
        compile=False if strategy.compile is None else strategy.compile, offload=strategy.offload,
        shard_size=(strategy.shard_size or strategy.num_processes) if strategy.sharding == "hybrid" else None,
    )
    forget_placeholders(placeholders)
    if from_meta and init_peft_adapters(runtime):  # not the generic init materialising gave them
        rank_zero_debug("lightning_shard: the peft adapters built on the meta device initialised as peft"
                        " initialises them (init_lora_weights), not by their layers' generic init.")
    if built(model):  # models from lightning_shard.from_pretrained: their folders, now that they are sharded
        load_pretrained(model)  # (DoRA's magnitudes from the base loaded: peft_meta.py)
    elif placeholders:  # DoRA's magnitudes from the base as materialised (load_pretrained computes them again)
        init_dora_magnitudes(runtime, model)
    rank_zero_info(plan_summary(runtime, strategy.sharding, strategy.world_size))
    rank_zero_debug("lightning_shard units:\n" + plan_listing(runtime))


def refuse_callbacks(trainer: "pl.Trainer") -> None:
    """A fit's callbacks that cannot run on a sharded model, refused before it is sharded: the model stays whole (a
    fit under another strategy may take it), and OnExceptionCheckpoint saves it as DDP would, rather than calling their
    ``on_save_checkpoint`` on the shards."""
    refuse_weight_averaging(trainer.callbacks)
    refuse_pruning(trainer.callbacks)


def prepare_fit(strategy: Any, trainer: "pl.Trainer") -> None:
    """A fit's setup, once the optimizers are attached and their state moved (the strategy's setup): what the callbacks
    ask refused or summarised, and what the strategy decides for the whole fit (gradients freed after each step,
    offload's overlap, the memory estimate)."""
    strategy.checkpoints.check_module_state_dict(strategy.runtime, strategy.state_dict_type)
    summarize_in_full_shapes(trainer.callbacks)
    strategy.frees_grads_after_step = frees_grads_after_step(trainer, strategy.free_grads_after_step)
    strategy.offload_overlap_clip = overlap_clip(trainer, strategy.precision_plugin.precision,
                                                 strategy.offload_overlap and strategy.offload is not None)
    strategy.runtime.restage_each_step = strategy.offload_overlap_clip is None or restage_each_step(trainer)
    strategy.memory_estimate = report_memory_estimate(strategy, trainer)
    if strategy.async_save:
        strategy.checkpoints.prepare_background_saves(strategy.runtime, strategy.processes.timeout,
                                                      strategy.root_device, strategy.memory_estimate, trainer.callbacks)
