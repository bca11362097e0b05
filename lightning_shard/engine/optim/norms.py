"""Gradient norms over every rank's shards, and clipping by them: the same numbers as
``torch.nn.utils.clip_grad_norm_`` and Lightning's ``grad_norm`` on the unsharded model (torch's own foreach
kernels do the local work, one all-reduce combines the ranks).

A p-norm of a sharded gradient is ``(sum over ranks of |local shard|_p ** p) ** (1/p)`` (the max over ranks for
p = inf). A gradient every rank holds whole (a replicated unit) counts once, from rank 0. The ranks are those of
the shard group: under hybrid sharding the replicas hold identical gradient shards (all-reduced), so each shard
group computes the same norm alone, and nothing is counted once per replica."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats
from lightning_shard.engine.storage.unit import Unit


def check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0):  # also refuses nan
        raise ValueError(f"lightning_shard: `norm_type` must be a positive number or 'inf', got {norm_type}.")
    return norm_type


@torch.no_grad()
def grad_norms(grads: list[Optional[Tensor]], sharded: list[bool], norm_type: float, device: torch.device,
               group: Optional[dist.ProcessGroup], stats: CommStats) -> tuple[Tensor, Tensor, Tensor]:
    """Per gradient, its norm over all ranks' shards; the norm of all of them together (fp32); and whether each is a
    gradient on some rank (bool, on ``device``: read by the host only where needed).

    ``sharded[i]``: whether ``grads[i]`` is this rank's part of a gradient split over the ranks (else every rank
    holds it whole). Every rank must call it with the same parameters' gradients, in the same order; one that is
    None on some ranks only (a rank-local ``p.grad = None``) counts as zeros there, so that every rank all-reduces
    the same number of norms."""
    norm_type = check_norm_type(norm_type)
    # low-precision gradients are summed in fp32, as the unsharded fp32 reference would be; powers in fp64,
    # where a large p cannot overflow
    # an empty shard has norm 0 (foreach's inf-norm refuses it): a zero stands in for it. No indexing by a host list,
    # nor a tensor built from one on the device: each would be a copy the host waits for
    standing = [g.float() if g is not None and g.numel() else torch.zeros(1, dtype=torch.float32, device=device)
                for g in grads]
    local = (torch.stack(torch._foreach_norm(standing, norm_type)).to(device=device, dtype=torch.float64)
             if grads else torch.zeros(0, dtype=torch.float64, device=device))
    present = torch.tensor([g is not None for g in grads], dtype=torch.bool).to(device, non_blocking=True)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1 and any(sharded):
        # one all-reduce: the norms, then a flag per gradient (summed, or the max for p = inf: nonzero where any rank
        # has it)
        flags = present.to(torch.float64)
        if math.isinf(norm_type):
            combined = torch.cat([local, flags])
            collectives.all_reduce(combined, group, stats, op=dist.ReduceOp.MAX,
                                   label="all-reduce of the gradient norms").wait()
        else:
            once = torch.tensor(sharded).to(device, non_blocking=True) | (dist.get_rank(group) == 0)
            combined = torch.cat([torch.where(once, local.pow(norm_type), 0.0), flags])
            collectives.all_reduce(combined, group, stats, label="all-reduce of the gradient norms").wait()
            combined[: len(grads)] = combined[: len(grads)].pow(1 / norm_type)
        combined, present = combined[: len(grads)], combined[len(grads):] > 0
    else:
        combined = local
    if not grads:
        total = torch.zeros((), dtype=torch.float64, device=device)
    elif math.isinf(norm_type):
        total = combined.max()
    else:
        total = combined.pow(norm_type).sum().pow(1 / norm_type)
    return combined.float(), total.float(), present


@torch.no_grad()
def clip_grad_norm_(parameters: list[Tensor], sharded: list[bool], max_norm: float, norm_type: float,
                    device: torch.device, group: Optional[dist.ProcessGroup], stats: CommStats) -> Tensor:
    """Scale every gradient by ``max_norm / total norm`` where that is below 1; returns the total norm."""
    total = total_grad_norm(parameters, sharded, norm_type, device, group, stats)
    kept = [p for p in parameters if p.grad is not None]
    if kept:
        torch.nn.utils.clip_grads_with_norm_(kept, max_norm, total, foreach=True)
    return total


@torch.no_grad()
def total_grad_norm(parameters: list[Tensor], sharded: list[bool], norm_type: float, device: torch.device,
                    group: Optional[dist.ProcessGroup], stats: CommStats) -> Tensor:
    """The norm of the gradients ``parameters`` have, over every rank's shards (what clipping scales by)."""
    return grad_norms([p.grad for p in parameters], sharded, norm_type, device, group, stats)[1]


class GradientNorms:
    """A sharded model's gradient norms, as the unsharded model's (a part of ShardRuntime)."""

    def __init__(self, units: list[Unit], root: nn.Module, group: Optional[dist.ProcessGroup], stats: CommStats,
                 host_stepper: Any = None) -> None:
        self.units = units
        self.root = root
        self.group = group  # the shard group: replicas hold the same gradient shards (see the module note)
        self.stats = stats
        self.host_stepper = host_stepper  # offload's overlapped step, which clips at the end of backward
        self.grad_norms_read = False  # grad_norms() was called

    def clip_grad_norm_(self, parameters: list[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm over all shards, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""
        if self.host_stepper is not None:  # offload's overlapped step clipped already, at the end of backward
            clipped = self.host_stepper.clipped(list(parameters), max_norm, norm_type)
            if clipped is not None:
                return clipped
        shards, sharded = self._shards_of(list(parameters))
        return clip_grad_norm_(shards, sharded, max_norm, norm_type, self.units[0].storage.device, self.group,
                               self.stats)

    def total_grad_norm(self, parameters: list[Tensor], norm_type: float = 2.0) -> Tensor:
        """The norm :meth:`clip_grad_norm_` would clip ``parameters`` by (every rank must call it)."""
        shards, sharded = self._shards_of(list(parameters))
        return total_grad_norm(shards, sharded, norm_type, self.units[0].storage.device, self.group, self.stats)

    def grad_norms(self, norm_type: float = 2.0) -> tuple[list[str], Tensor, Tensor]:
        """The names of the parameters that have a gradient, each one's gradient norm over all shards, and their
        total norm: Lightning's ``grad_norm(model, norm_type)`` on the unsharded model."""
        self.grad_norms_read = True  # (the strategy's warning about Lightning's grad_norm of the shards is not needed)
        named = list(self.root.named_parameters())
        shards, sharded = self._shards_of([p for _, p in named])
        each, total, present = grad_norms([shard.grad for shard in shards], sharded, norm_type,
                                          self.units[0].storage.device, self.group, self.stats)
        kept = present.nonzero().flatten().tolist()  # a gradient on some rank (the ranks agree)
        return [named[i][0] for i in kept], each[kept], total

    def _shards_of(self, parameters: list[Tensor]) -> tuple[list[nn.Parameter], list[bool]]:
        """The shard parameters (which hold the gradients) of ``parameters``, given as shards or as the gathered
        parameters the tree holds mid-step, and whether each is split over the ranks (else replicated)."""
        known = {}
        for unit in self.units:
            for shard, gathered in zip(unit.storage.shard_params, unit.storage.gathered_params):
                known[id(shard)] = known[id(gathered)] = (shard, unit.storage.world_size > 1)
        unknown = [i for i, p in enumerate(parameters) if id(p) not in known]
        if unknown:
            raise ValueError(f"lightning_shard: parameters {unknown[:4]} (by position) are not the sharded model's:"
                             " gradient norms are taken over its parameters (model.parameters(), the optimizer's).")
        found = [known[id(p)] for p in parameters]
        return [shard for shard, _ in found], [split for _, split in found]
