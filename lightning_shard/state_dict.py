"""Full (unsharded) model state dicts, one unit at a time: no rank ever holds the whole model at once
beyond the result it returns."""

from __future__ import annotations

from collections.abc import Mapping
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard import collectives
from lightning_shard.flat_shard import FlatShard
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


@torch.no_grad()
def load_full_state_dict(runtime: ShardRuntime, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Load an unsharded state dict: each rank copies only the slices its shards own."""
    expected = set(runtime.root.state_dict().keys())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if strict and (missing or unexpected):
        raise KeyError(f"State dict does not match the model: missing keys {missing}, unexpected keys {unexpected}.")
    for unit in runtime.units:
        storage = unit.storage
        for slot, shard_param in zip(storage.slots, storage.shard_params):
            name = next((n for n in slot.names if n in state), None)
            if name is None:
                continue
            value = state[name]
            if value.shape != slot.shape:
                raise ValueError(f"Shape mismatch for {name!r}: checkpoint has {tuple(value.shape)}, model {tuple(slot.shape)}.")
            lo, hi = storage.shard_range(slot)
            start = storage.shard_start + lo - slot.offset
            shard_param.copy_(value.reshape(-1)[start : start + hi - lo])
        if unit.is_gathered:  # keep a gathered copy consistent with the new shards
            unit.is_gathered = False
            runtime.gather(unit)
    param_names = {n for unit in runtime.units for s in unit.storage.slots for n in s.names}
    buffers = {k: v for k, v in state.items() if k not in param_names}
    runtime.root.load_state_dict(buffers, strict=False)

