"""The plan of an optimizer step under sharding: which parameters are stepped together (bounded groups), and
for whole-parameter optimizers which rank owns each parameter. Pure layout, computed the same way on every
rank from the optimizer's parameter groups and the units' shapes; no communication here.

Groups bound the step's memory: an optimizer's temporaries (``torch._foreach`` lists on a GPU, Muon's
Newton-Schulz matrices, the owners' full copies) then scale with one group, not with the model (DeepSpeed
ZeRO-3's ``sub_group_size``). Each parameter's update depends only on its own gradient and state, so stepping
group by group gives the same numbers as one step over all of them.

Owners are balanced by size within each group, carrying the ranks' loads from group to group (largest
parameter first, to the least loaded rank): a rank owns at most ``total / N + largest parameter`` elements,
and every rank has work in every group, so the groups' exchanges overlap other ranks' optimizer compute.
A parameter keeps its owner when the plan is made again (a param group added during fit): its optimizer state
lives there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.engine.storage.flat_shard import FlatShard

SHARDS, VIEWS, OWNERS = "shards", "views", "owners"


@dataclass(eq=False)
class Entry:
    """One parameter of the optimizer: the shard parameter it holds, and where that lives in the model."""

    group: int  # index of its param group
    param: nn.Parameter  # what the optimizer holds between steps (a 1-D shard, or a tensor not in the model)
    storage: Optional[FlatShard] = None  # None: not a parameter of the sharded model, stepped as it is
    slot: int = 0
    unit: int = 0  # the unit's index, for grouping by unit

    @property
    def shape(self) -> torch.Size:
        return self.storage.slots[self.slot].shape if self.storage is not None else self.param.shape

    @property
    def numel(self) -> int:
        return self.storage.slots[self.slot].numel if self.storage is not None else self.param.numel()

    @property
    def name(self) -> str:
        return self.storage.slots[self.slot].names[0] if self.storage is not None else "<not in the model>"

    def piece(self, rank: int) -> tuple[int, int]:
        """The offsets of ``rank``'s part of the flattened parameter."""
        assert self.storage is not None
        return self.storage.param_range(self.storage.slots[self.slot], rank)

    def piece_len(self, rank: int) -> int:
        lo, hi = self.piece(rank)
        return hi - lo

    def local_values(self) -> Tensor:
        """This rank's part of the master parameter (a view of its shard)."""
        assert self.storage is not None
        return self.storage.shard_params[self.slot].detach()


@dataclass(eq=False)
class Bucket:
    """Parameters stepped together: ``shards`` (1-D shards as they are), ``views`` (whole parameters, each
    rank holding all of it: one rank, or ``sharding="none"``) or ``owners`` (whole parameters on owner ranks)."""

    mode: str
    entries: list[Entry]
    owners: list[int] = field(default_factory=list)  # per entry, ``owners`` mode only


@dataclass
class StepPlan:
    buckets: list[Bucket]
    key: tuple  # the optimizer's parameters per group when planned: a change means planning again

    def __post_init__(self) -> None:
        self.owners = {id(e.param): o for b in self.buckets for e, o in zip(b.entries, b.owners)}

    def owner(self, param: Tensor) -> Optional[int]:
        """The rank that holds ``param``'s optimizer state, or None when every rank holds its own (its shard)."""
        return self.owners.get(id(param))


def params_key(optimizer: Optimizer) -> tuple:
    return tuple(tuple(map(id, group["params"])) for group in optimizer.param_groups)


def plan_step(optimizer: Optimizer, where: dict[int, tuple[int, FlatShard, int]], whole: bool, world: int,
              group_numel: int, kept_owners: Optional[dict[int, int]] = None) -> StepPlan:
    """``where``: id(shard parameter) -> (unit index, storage, slot). ``whole``: the optimizer steps whole
    parameters. ``group_numel``: elements stepped at once per rank. ``kept_owners``: id(shard parameter) -> the
    owner an earlier plan gave it, kept."""
    entries = []
    for g, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            unit, storage, slot = where.get(id(param), (0, None, 0))
            entries.append(Entry(g, param, storage, slot, unit))
    foreign = [e for e in entries if e.storage is None]
    sharded = [e for e in entries if e.storage is not None]
    buckets: list[Bucket] = []
    if foreign:
        buckets.append(Bucket(SHARDS, foreign))  # the user's own tensors: stepped as they are, on every rank
    if not whole:
        buckets += [Bucket(SHARDS, b) for b in _split(sharded, group_numel, _local_numel)]
    elif world == 1 or all(e.storage.world_size == 1 for e in sharded):
        buckets += [Bucket(VIEWS, b) for b in _split(sharded, group_numel, lambda e: e.numel)]
    else:
        buckets += _owner_buckets(sharded, world, group_numel, kept_owners or {})
    return StepPlan(buckets, params_key(optimizer))


def _local_numel(entry: Entry) -> int:
    return entry.piece_len(entry.storage.rank) if entry.storage is not None else entry.param.numel()


def _split(entries: list[Entry], limit: int, size) -> list[list[Entry]]:
    """Consecutive entries in groups of at most ``limit`` elements (a larger parameter is a group of its own);
    a group holds one dtype and device, so that it can travel in one buffer."""
    groups: list[list[Entry]] = []
    total, kind = 0, None
    for entry in entries:
        this = (entry.param.dtype, entry.param.device)
        if not groups or total + size(entry) > limit or this != kind:
            groups.append([])
            total, kind = 0, this
        groups[-1].append(entry)
        total += size(entry)
    return groups


def _owner_buckets(entries: list[Entry], world: int, group_numel: int, kept: dict[int, int]) -> list[Bucket]:
    """By unit (a unit's parameters are reduced together, so they are ready together), then by size; owners
    balanced within each bucket, loads carried over, ``kept`` owners (id(parameter) -> rank) kept."""
    by_unit: dict[int, list[Entry]] = {}
    for entry in sorted(entries, key=lambda e: (e.unit, e.slot)):
        by_unit.setdefault(entry.unit, []).append(entry)
    chunks = [chunk for unit in by_unit.values() for chunk in _split(unit, group_numel * world, lambda e: e.numel)]
    loads = [0] * world
    for entry in entries:
        if id(entry.param) in kept:
            loads[kept[id(entry.param)]] += entry.numel
    buckets = []
    for chunk in chunks:
        owners = [kept.get(id(e.param), -1) for e in chunk]
        for i in sorted((i for i in range(len(chunk)) if owners[i] < 0), key=lambda i: -chunk[i].numel):
            owner = min(range(world), key=lambda r: (loads[r], r))
            owners[i] = owner
            loads[owner] += chunk[i].numel
        buckets.append(Bucket(OWNERS, chunk, owners))
    return buckets
