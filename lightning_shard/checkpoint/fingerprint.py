"""Fingerprints of parameters that a checkpoint leaves out (``ShardStrategy(save_frozen=False)``: a LoRA run's frozen
base), so that a resume can tell the same base from another one without the checkpoint holding it.

A parameter's fingerprint is the sum over its elements of the element's bits times a weight drawn from the
element's position in the parameter, in wrapping 64-bit integers: a sum, so each rank adds up the elements it
owns and one all-reduce completes it, whatever the number of ranks or the unit layout; every bit of every element
counts. It tells a different base apart, not an adversary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.engine.comm import collectives
from lightning_shard.engine.runtime.hooks import ShardRuntime

_CHUNK = 1 << 22  # elements hashed at once: the temporaries stay small
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _partial(values: Tensor, start: int) -> Tensor:
    """The fingerprint's part for ``values``, the flat elements at ``start, start + 1, ...`` of a parameter."""
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    bits = values.detach().reshape(-1).view(_BITS[values.element_size()])
    for lo in range(0, bits.numel(), _CHUNK):
        chunk = bits[lo: lo + _CHUNK].to(torch.int64)
        position = torch.arange(start + lo, start + lo + chunk.numel(), dtype=torch.int64, device=values.device)
        weight = (position * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF  # odd, well mixed, never zero-width
        total += (chunk * weight).sum()
    return total


def fingerprints(runtime: ShardRuntime, names: Iterable[str]) -> dict[str, int]:
    """The fingerprints of the sharded model's parameters ``names`` (every rank must call it: one all-reduce)."""
    wanted = set(names)
    found: list[tuple[str, Tensor]] = []
    for unit in runtime.units:
        storage = unit.storage
        for slot, shard in zip(storage.slots, storage.shard_params):
            name = slot.names[0]
            if any(n in wanted for n in slot.names):
                lo, _ = storage.param_range(slot, storage.rank)
                found.append((name, _partial(shard, lo)))
    if not found:
        return {}
    totals = torch.stack([value for _, value in found])
    if runtime.groups.shard_size > 1:  # replicas hold the same shards: the sum is over one shard group
        collectives.all_reduce(totals, runtime.groups.shard, runtime.stats, op=dist.ReduceOp.SUM,
                               label="all-reduce of the frozen parameters' fingerprints").wait()
    return dict(zip((name for name, _ in found), totals.tolist()))


def frozen_names(runtime: ShardRuntime, optimizers: Iterable[object] = ()) -> set[str]:
    """Every name (ties included) of the sharded model's parameters that do not train now and never did: no
    ``optimizers`` holds state for them on any rank (one trained, then frozen again, differs from the base). Every
    rank must call it (one all-reduce)."""
    frozen = [(slot, shard) for unit in runtime.units for slot, shard in zip(unit.storage.slots, unit.storage.shard_params)
              if not shard.requires_grad]
    states = [getattr(o, "_optimizer", o).state for o in optimizers]
    trained = torch.tensor([any(shard in state for state in states) for _, shard in frozen], dtype=torch.int64)
    if runtime.world_size > 1 and len(frozen):  # whole-parameter optimizers keep a state on its owner only
        collectives.agree(trained, runtime.groups.agreements, runtime.stats,
                          label="agreement on the parameters ever trained")
    return {name for (slot, _), was in zip(frozen, trained.tolist()) if not was for name in slot.names}


def check_fingerprints(runtime: ShardRuntime, saved: dict[str, int], where: str) -> None:
    """The model's parameters ``saved`` were fingerprinted from (a checkpoint saved without them) are the same now:
    else an error naming them, on every rank (every rank must call it)."""
    now = fingerprints(runtime, saved)
    differ = sorted(name for name, value in saved.items() if now.get(name) != value)
    if differ:
        raise CheckpointError(
            f"Checkpoint {where!r} was saved without its frozen parameters (ShardStrategy(save_frozen=False)), and"
            f" the model's differ from those it was trained with: {differ[:6]}{' ...' if len(differ) > 6 else ''}"
            f" ({len(differ)} of {len(saved)}). Load the same base weights (load_pretrained in"
            " on_fit_start, once the model is sharded) before restoring it.")
