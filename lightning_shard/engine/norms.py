"""The global gradient norm over every rank's shards, and clipping by it: the same numbers as
``torch.nn.utils.clip_grad_norm_`` on the unsharded model (torch's own foreach kernels do the local work)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.engine import collectives
from lightning_shard.engine.collectives import CommStats


@torch.no_grad()
def total_grad_norm(grads: list[Tensor], device: torch.device, group: Optional[dist.ProcessGroup],
                    stats: CommStats, sharded: bool) -> Tensor:
    """The 2-norm of all ranks' gradient shards together (fp32; every rank must call it when ``sharded``)."""
    # low-precision gradients are summed in fp32, as the unsharded fp32 reference would be
    grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
    local = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
    squares = local.to(device=device, dtype=torch.float32).square()
    if sharded and dist.is_initialized() and dist.get_world_size(group) > 1:
        collectives.all_reduce(squares, group, stats, label="all-reduce of the gradient norm").wait()
    return squares.sqrt()


@torch.no_grad()
def clip_grad_norm_(parameters: list[Tensor], max_norm: float, device: torch.device,
                    group: Optional[dist.ProcessGroup], stats: CommStats, sharded: bool) -> Tensor:
    """Scale every gradient by ``max_norm / total norm`` where that is below 1; returns the total norm."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = total_grad_norm([p.grad for p in parameters], device, group, stats, sharded)
    if parameters:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
    return norm
