"""Unit sizes for the memory estimate, counted by dtype: a unit's shard, gathered buffer and gradients in the dtypes it
holds them in. A unit of one dtype holds ``elements x size``; a unit of several (a bf16 base beside fp32 adapters,
packed 4-bit weights and their quantization state: ``engine/storage/mixed_shard.py``) is laid out here exactly as the engine
lays it out (``engine/storage/mixed_layout.py``), its bytes read off that layout, on the rank that holds the most of them
(their trainable parts are spread over the ranks unit by unit, so a rank's total is not a sum of each unit's most)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_shard.engine.plan.gathers import GatherDtypes
from lightning_shard.engine.storage.mixed_layout import MixedSlot, is_mixed, master_layout, mixed_slots, part, place
from lightning_shard.engine.storage.mixed_shard import MixedShard


@dataclass(frozen=True)
class UnitSize:
    padded: int  # elements of the gathered (padded) buffer (a unit of several dtypes: bytes)
    shard: int  # elements of one rank's shard (a unit of several dtypes: bytes)
    is_root: bool
    largest: int  # elements of its largest trainable parameter (what a for-loop optimizer's temporaries scale with)
    stepped: int  # elements of one rank's shard that train: what the optimizer keeps state for
    master_bytes: int  # one rank's master shard
    gathered_bytes: int  # the gathered buffer, in the dtypes the unit computes in
    graded: int  # elements of one rank's reduced gradient shard (0: nothing trains)
    grad_numel: int  # elements that get unsharded gradients in backward
    mixed: bool = False  # several dtypes: only what trains has gradient shards (a unit of one dtype: its whole shard)

    @property
    def gather_shard_bytes(self) -> int:
        """One rank's contribution to the all-gather (offload's staging and device copies)."""
        return self.gathered_bytes * self.shard // self.padded if self.padded else 0


def uniform_size(numel: int, ranks: int, is_root: bool, largest: int, trainable: int, master: torch.dtype,
                 compute: torch.dtype) -> UnitSize:
    """A unit of one dtype: a unit that trains reduces its whole flat shard (``engine/storage/flat_shard.py``), and one that
    does not gets no gradients at all (a frozen LoRA base's embeddings and head). The optimizer holds state for its
    trainable elements alone, counted whole on each rank (a LoRA unit's few may all lie in one rank's shard)."""
    shard = -(-numel // ranks)
    stepped = min(shard, trainable)
    return UnitSize(shard * ranks, shard, is_root, largest, stepped, shard * master.itemsize,
                    shard * ranks * compute.itemsize, shard if stepped else 0, shard * ranks if trainable else 0)


def mixed_size(slots: list[MixedSlot], shard_nbytes: int, ranks: int, is_root: bool, rank: int) -> UnitSize:
    """A unit of several dtypes, placed (``mixed_layout.place``), on ``rank``."""
    trainable = [s for s in slots if s.requires_grad]
    stepped = sum(hi - lo for lo, hi in (part(s, shard_nbytes, rank) for s in trainable))
    longest = max(sum(hi - lo for lo, hi in (part(s, shard_nbytes, r) for s in trainable)) for r in range(ranks))
    master = max(master_layout(slots, shard_nbytes, r)[1] for r in range(ranks))  # every rank's: the longest
    return UnitSize(shard_nbytes * ranks, shard_nbytes, is_root, max((s.numel for s in trainable), default=0), stepped,
                    master, shard_nbytes * ranks, longest,
                    sum(s.numel for s in trainable), mixed=True)


def _busiest(layouts: list[tuple[list[MixedSlot], int]], ranks: int) -> int:
    """The rank that steps the most elements of the units of several dtypes (their trainable parts are spread over
    the ranks: ``mixed_layout.place``)."""
    def held(rank: int) -> int:  # (every rank holds a unit's longest master shard)
        return sum(sum(hi - lo for lo, hi in (part(s, shard, rank) for s in slots if s.requires_grad))
                   for slots, shard in layouts)
    return max(range(ranks), key=held)


def planned_sizes(model: nn.Module, plans: list[Any], ranks: int, param_dtype: Optional[torch.dtype],
                  master_dtype: Optional[torch.dtype], cast_params: str = "all") -> list[UnitSize]:
    """From the planner's units of a model not sharded yet (any device, the meta one included). ``master_dtype``: the
    shards' dtype where the model will be converted to it before sharding (Lightning's ``bf16-true``);
    ``cast_params``: which parameters gather in ``param_dtype`` (engine/plan/gathers.py)."""
    sizes, loads, mixed = [], [0] * ranks, {}
    gathers = GatherDtypes(model, param_dtype, cast_params)
    for i, plan in enumerate(plans):
        if not plan.numel():
            continue
        params = [p for p, _ in plan.params]
        unit_gathers = gathers.for_unit(params)
        if is_mixed(plan, unit_gathers) and master_dtype is None:
            slots, _ = mixed_slots(model, plan, param_dtype, lambda m, a: f"{m}.{a}" if m else a, unit_gathers)
            layout = place(slots, ranks, loads)
            mixed[i] = (layout.slots, layout.shard_nbytes)
            continue
        master = master_dtype or params[0].dtype
        lowered = param_dtype if unit_gathers.of(*plan.params[0]) != params[0].dtype else None
        compute = lowered if lowered is not None and master.is_floating_point else master
        trainable = [p.numel() for p in params if p.requires_grad]
        sizes.append((i, uniform_size(plan.numel(), ranks, plan.members == [""], max(trainable, default=0),
                                      sum(trainable), master, compute)))
    rank = _busiest(list(mixed.values()), ranks)
    sizes += [(i, mixed_size(slots, shard, ranks, plans[i].members == [""], rank))
              for i, (slots, shard) in mixed.items()]
    return [size for _, size in sorted(sizes, key=lambda pair: pair[0])]


def sharded_sizes(runtime: Any) -> list[UnitSize]:
    """Read off a sharded model's units."""
    mixed = [unit for unit in runtime.units if isinstance(unit.storage, MixedShard)]
    rank = _busiest([(u.storage.slots, u.storage.shard_numel) for u in mixed], runtime.units[0].storage.world_size)
    sizes = []
    for unit in runtime.units:
        storage, is_root = unit.storage, unit is runtime.root_unit
        if unit in mixed:
            sizes.append(mixed_size(storage.slots, storage.shard_numel, storage.world_size, is_root, rank))
            continue
        trainable = [s.numel for s, trains in zip(storage.slots, storage.requires_grad) if trains]
        sizes.append(uniform_size(storage.padded_numel, storage.world_size, is_root, max(trainable, default=0),
                                  sum(trainable), storage.master_dtype, storage.param_dtype))
    return sizes
