"""Full (unsharded) model state dicts, one unit at a time: no rank ever holds the whole model at once
beyond the result it returns."""

from __future__ import annotations

from collections.abc import Mapping
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard import collectives
from lightning_shard.flat_shard import FlatShard
from lightning_shard.pretrained import TensorSource, load_into
from lightning_shard.runtime import ShardRuntime


def gather_master(runtime: ShardRuntime, storage: FlatShard) -> Tensor:
    """The unit's full flat buffer of master values (padded), on every rank."""
    if storage.world_size == 1:
        return storage.shard
    out = storage.shard.new_empty(storage.padded_numel)
    return collectives.all_gather(out, storage.shard, runtime.group, runtime.stats).wait()


@torch.no_grad()
def full_state_dict(runtime: ShardRuntime, rank0_only: bool = True) -> dict[str, Tensor]:
    """The state dict of the unsharded module, on CPU, with the original names and shapes.

    Every rank must call it (it all-gathers); with ``rank0_only`` other ranks get ``{}``.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    state = runtime.root.state_dict() if keep else {}
    for unit in runtime.units:
        flat = gather_master(runtime, unit.storage)
        if not keep:
            continue
        for slot in unit.storage.slots:
            value = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).cpu().clone()
            for name in slot.names:
                if name in state:
                    state[name] = value
    return {k: v.detach().cpu() for k, v in state.items()} if keep else {}


def load_full_state_dict(runtime: ShardRuntime, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Load an unsharded state dict: each rank copies only the slices its shards own."""
    load_into(runtime, TensorSource(state), strict=strict)
