"""The collectives the engine uses, as free functions that also count what they move.

They know nothing of modules or hooks: a flat buffer goes in, a flat buffer (or a work handle) comes out.
``async_op=True`` returns a :class:`Pending` whose ``wait()`` is accounted as exposed communication.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.12 names them *_single; the older names warn as deprecated there.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Communication of the current step (reset by the runtime at each step)."""

    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0
    collectives: int = 0
    exposed_seconds: float = 0.0  # time the compute path spent blocked in wait()

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


@dataclass
class Pending:
    """An in-flight collective and the buffers it must keep alive until it completes."""

    work: Optional[dist.Work]
    result: Tensor
    stats: CommStats
    keep_alive: tuple = field(default_factory=tuple)

    def wait(self) -> Tensor:
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            self.stats.exposed_seconds += time.perf_counter() - start
            self.work = None
            self.keep_alive = ()
        return self.result


def _run(op, stats: CommStats, result: Tensor, async_op: bool, keep_alive: tuple, *args, **kwargs) -> Pending:
    stats.collectives += 1
    if async_op:
        return Pending(op(*args, async_op=True, **kwargs), result, stats, keep_alive)
    start = time.perf_counter()
    op(*args, **kwargs)
    stats.exposed_seconds += time.perf_counter() - start
    return Pending(None, result, stats)


def all_gather(output: Tensor, shard: Tensor, group, stats: CommStats, async_op: bool = False) -> Pending:
    """Gather every rank's ``shard`` into ``output`` (rank-major)."""
    # Writing into a parameter's storage is not an autograd-visible change of its value.
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(output):
        stats.all_gather_bytes += output.numel() * output.element_size()
        return _run(_all_gather, stats, output, async_op, (shard,), output, shard, group=group)


def reduce_scatter(flat: Tensor, group, stats: CommStats, async_op: bool = False) -> Pending:
    """Sum ``flat`` over ranks; this rank receives its 1/N slice."""
    world = dist.get_world_size(group)
    output = flat.new_empty(flat.numel() // world)
    stats.reduce_scatter_bytes += flat.numel() * flat.element_size()
    return _run(_reduce_scatter, stats, output, async_op, (flat,), output, flat, op=dist.ReduceOp.SUM, group=group)


def all_reduce(flat: Tensor, group, stats: CommStats, async_op: bool = False) -> Pending:
    """Sum ``flat`` over ranks, in place."""
    stats.all_reduce_bytes += flat.numel() * flat.element_size()
    return _run(dist.all_reduce, stats, flat, async_op, (), flat, op=dist.ReduceOp.SUM, group=group)
