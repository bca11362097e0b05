"""lightning_shard: fully sharded data parallel training for PyTorch Lightning.

Importing the package registers the strategy names ``"lightning_shard"``, ``"lightning_shard_grad_op"``
and ``"lightning_shard_no_shard"`` with Lightning's ``StrategyRegistry``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_shard.consolidate import consolidate
from lightning_shard.precision import MixedPrecision
from lightning_shard.pretrained import load_pretrained
from lightning_shard.shard_module import shard_module
from lightning_shard.strategy import ShardStrategy

ShardStrategy.register_strategies(StrategyRegistry)

__all__ = ["MixedPrecision", "ShardStrategy", "consolidate", "load_pretrained", "shard_module"]
