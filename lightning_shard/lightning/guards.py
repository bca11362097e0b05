"""Refusals for a model that is already sharded: another strategy's Trainer, a layer conversion after sharding, a
callback that keeps a copy of the model's parameters, or one that prunes them."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerStatus


def refuse_other_strategies(model: Any, strategy_class: type) -> None:
    """Run at every conversion of a sharded model (``model.to(device)``, the first thing a Lightning strategy's
    setup does): a Trainer with another strategy would step its 1-D shards as if they were the model (DDP
    would broadcast rank 0's shards over the others' first)."""
    trainer = getattr(model, "_trainer", None)
    if trainer is None or trainer.state.status != TrainerStatus.RUNNING:  # a finished one: the user's own call
        return
    strategy = trainer.strategy
    if not isinstance(strategy, strategy_class):
        raise RuntimeError(
            f"lightning_shard: this model was sharded by ShardStrategy (its parameters are 1-D shards of the"
            f" model's), so a Trainer with {type(strategy).__name__} cannot run it. Use"
            " Trainer(strategy=ShardStrategy(...)) with the options it was sharded with, or a fresh model."
        )


def refuse_layer_sync_on_sharded(model: Any) -> None:
    """``sync_batchnorm=True`` replaces batch norms by new modules, which would hold the old ones' shards."""
    plain = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)]
    if plain:
        raise ValueError(
            f"lightning_shard: `sync_batchnorm=True` on a model sharded without it would replace its batch norms"
            f" ({plain[:4]}) after sharding. Give the Trainer that first sharded it `sync_batchnorm=True`, or use"
            " a fresh model."
        )


def refuse_weight_averaging(callbacks: list) -> None:
    """Lightning's weight-averaging callbacks (``EMAWeightAveraging``, ``WeightAveraging``,
    ``StochasticWeightAveraging``) copy the LightningModule (before sharding: the whole model on every rank) and
    average its parameters into the copy, whose shapes the 1-D shards do not match: refused at setup, naming them
    and the sharded ones, rather than a shape error at the first update."""
    from lightning.pytorch import callbacks as lightning_callbacks

    kinds = tuple(getattr(lightning_callbacks, name) for name in ("WeightAveraging", "StochasticWeightAveraging")
                  if hasattr(lightning_callbacks, name))
    averaging = [type(c).__name__ for c in callbacks if isinstance(c, kinds)]
    if averaging:
        raise ValueError(
            f"lightning_shard: {averaging} keep a copy of the whole model and average its parameters, which under"
            " ShardStrategy are 1-D shards of another shape. Use lightning_shard.ShardedEMA for EMAWeightAveraging,"
            " and lightning_shard.ShardedWeightAveraging for WeightAveraging or StochasticWeightAveraging (the equal"
            " average by default, or your avg_fn / multi_avg_fn): Lightning's options and checkpoint layout, the"
            " average sharded like the model.")


def refuse_pruning(callbacks: list) -> None:
    """Lightning's ``ModelPruning`` prunes with torch.nn.utils.prune on the parameters it finds, which under
    ShardStrategy are 1-D shards: each rank would compute its own threshold from its shard (a global one from all its
    shards), and the reparametrization it leaves is not what a gather reads. Refused at setup, naming it; its pruning
    functions are refused at the moment they run, wherever they are called from (engine/storage/outside.py)."""
    from lightning.pytorch.callbacks import ModelPruning

    pruning = [type(c).__name__ for c in callbacks if isinstance(c, ModelPruning)]
    if pruning:
        raise ValueError(
            f"lightning_shard: {pruning} prune with torch.nn.utils.prune, computing masks and thresholds from each"
            " parameter it is given, which under ShardStrategy is this rank's 1-D shard of it: the pruning would differ"
            " per rank and be lost at the next gather. Prune the consolidated model after training"
            " (`python -m lightning_shard.consolidate`, then ModelPruning's pruning function on the plain model), or"
            " train with strategy='ddp' to prune during training.")
