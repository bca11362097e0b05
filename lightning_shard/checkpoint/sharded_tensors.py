"""Describe this rank's part of a parameter to ``torch.distributed.checkpoint`` in the parameter's own shape.

A rank owns a contiguous range of each parameter's flattened elements (see ``flat_shard``). In the
original shape such a range is a few rectangular blocks (a partial row, whole rows, a partial row,
recursively), each itself contiguous, so every block is a view of the local 1-D shard. Wrapped as a
``ShardedTensor`` those views are what DCP writes and loads in place: the checkpoint holds each parameter
under its own name and shape, independent of world size and unit policy, so it reshards on load and
consolidates into an ordinary state dict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

Block = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, first flat index)


def range_blocks(shape: Sequence[int], lo: int, hi: int) -> list[Block]:
    """Split the flat elements ``[lo, hi)`` of a row-major tensor of ``shape`` into rectangular blocks."""
    blocks: list[Block] = []

    def split(dims: tuple[int, ...], prefix: tuple[int, ...], lo: int, hi: int, base: int) -> None:
        if lo >= hi:
            return
        if not dims:
            blocks.append((prefix, (1,) * len(prefix), base))
            return
        row = math.prod(dims[1:])
        first_whole, end_whole = -(-lo // row) * row, (hi // row) * row
        if first_whole > end_whole:  # strictly inside one row
            r = lo // row
            split(dims[1:], prefix + (r,), lo - r * row, hi - r * row, base + r * row)
            return
        if lo < first_whole:
            r = lo // row
            split(dims[1:], prefix + (r,), lo - r * row, row, base + r * row)
        if first_whole < end_whole:
            rest = (0,) * (len(dims) - 1)
            sizes = (1,) * len(prefix) + ((end_whole - first_whole) // row,) + dims[1:]
            blocks.append((prefix + (first_whole // row,) + rest, sizes, base + first_whole))
        if end_whole < hi:
            r = end_whole // row
            split(dims[1:], prefix + (r,), 0, hi - end_whole, base + end_whole)

    split(tuple(shape), (), lo, hi, 0)
    return blocks


def sharded_view(
    shape: Sequence[int], ranges: Sequence[tuple[int, int]], rank: int, local: Tensor,
    global_ranks: Optional[Sequence[int]] = None,
) -> Optional[Union[ShardedTensor, Tensor]]:
    """A checkpointable view of a tensor of ``shape`` whose flat range ``ranges[r]`` lives on shard rank ``r``,
    the global rank ``global_ranks[r]`` (default ``r``: the shard group is the world).

    ``local`` is this rank's part (1-D, ``ranges[rank]`` long); the result shares its storage, so DCP
    saves from it and loads into it. A tensor held whole by its rank (replicated, or of fewer than two
    elements) is a plain tensor, and ``None`` on a rank holding none of it: DCP writes one copy of a
    plain tensor, so only holders may offer it. Replicas (hybrid sharding) offer the same blocks, at the same
    offsets, each placed on its own ranks: DCP writes one copy of each block.
    """
    shape = torch.Size(shape)
    if len(ranges) == 1 or shape.numel() < 2:
        return local.view(shape) if local.numel() == shape.numel() else None
    placement_device = local.device
    shards_md: list[ShardMetadata] = []
    local_shards: list[Shard] = []
    my_lo = ranges[rank][0]
    for r, (lo, hi) in enumerate(ranges):
        for offsets, sizes, start in range_blocks(shape, lo, hi):
            placed = global_ranks[r] if global_ranks is not None else r
            md = ShardMetadata(list(offsets), list(sizes), f"rank:{placed}/{placement_device}")
            shards_md.append(md)
            if r == rank:
                view = local[start - my_lo : start - my_lo + math.prod(sizes)].view(sizes)
                local_shards.append(Shard(view, md))
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_md, shape, properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)
