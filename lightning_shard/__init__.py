"""lightning_shard: fully sharded data parallel training for PyTorch Lightning.

Layers, each importing only those before it:

    engine/      units, flat shards, gather -> compute -> free, reduce-scatter (plain torch.distributed)
    checkpoint/  full and sharded state, files, consolidation, pretrained weights
    memory/      the memory estimator and tracker
    lightning/   ShardStrategy and its precision plugin
    app/         the Hydra training app, its configs, example models and data
    tools/       benchmarks

Importing the package registers the strategy names ``"lightning_shard"``, ``"lightning_shard_grad_op"``,
``"lightning_shard_hybrid"`` and ``"lightning_shard_no_shard"`` with Lightning's ``StrategyRegistry``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_shard.checkpoint.consolidate import consolidate
from lightning_shard.checkpoint.export import save_pretrained
from lightning_shard.checkpoint.from_pretrained import from_pretrained
from lightning_shard.checkpoint.pretrained import load_pretrained
from lightning_shard.engine.shard_module import shard_module
from lightning_shard.lightning.callbacks import SavePretrained
from lightning_shard.lightning.ema import ShardedEMA
from lightning_shard.lightning.precision import MixedPrecision
from lightning_shard.lightning.strategy import ShardStrategy
from lightning_shard.lightning.weight_averaging import ShardedWeightAveraging

ShardStrategy.register_strategies(StrategyRegistry)

__all__ = ["MixedPrecision", "SavePretrained", "ShardStrategy", "ShardedEMA", "ShardedWeightAveraging", "consolidate",
           "from_pretrained", "load_pretrained", "save_pretrained", "shard_module"]
