"""lightning_shard: fully sharded data parallel training for PyTorch Lightning."""

from lightning_shard.shard_module import shard_module

__all__ = ["shard_module"]
