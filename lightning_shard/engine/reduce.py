"""Gradient reduction: each unit's gradients reduce-scattered (async) once its backward is done, so every
rank keeps only the gradient of the shard it owns, averaged over ranks like DDP.

At most ``MAX_PENDING_REDUCTIONS`` reductions are in flight: each holds a unit's full gradient until it
completes, and unbounded they would hold the whole model's by the end of backward.

Which collectives run and which gradients count is never one rank's local view: every unit with trainable
parameters is reduced once per backward on every rank (a unit that got no gradient here contributes
zeros), and a parameter keeps ``grad=None`` only if it got no gradient on *any* rank, agreed by one small
all-reduce of the ranks' used-parameter masks at the end of backward (DDP's ``find_unused_parameters``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.engine import collectives
from lightning_shard.engine.collectives import CommStats, Pending
from lightning_shard.engine.gather import GatherSchedule
from lightning_shard.engine.unit import Unit

MAX_PENDING_REDUCTIONS = 2  # one overlapping the next unit's backward, one completing


class GradientReducer:
    def __init__(self, units: list[Unit], group: Optional[dist.ProcessGroup], world_size: int,
                 reduce_dtype: Optional[torch.dtype], stats: CommStats, schedule: GatherSchedule) -> None:
        self.units = units
        self.group = group
        self.world_size = world_size
        self.reduce_dtype = reduce_dtype
        self.stats = stats
        self.schedule = schedule  # for its trace
        self.sync_grads = True  # False while accumulating without reduction (see no_sync)
        self._pending: list[tuple[Unit, Pending, list[int]]] = []
        self._reduced: list[tuple[Unit, Tensor, list[int]]] = []  # waiting for the ranks' agreed used-mask
        self._done: set[int] = set()  # ids of units reduced in this backward

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally, without reduction (costs a full gradient per unit)."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    def reduce(self, unit: Unit) -> None:
        """Start reducing the unit's gradients (nothing to do if it has none, or while not syncing)."""
        storage = unit.storage
        if not self.sync_grads or not storage.trainable or id(unit) in self._done:
            return
        self._done.add(id(unit))
        flat, used = storage.take_unsharded_grads(self.reduce_dtype or storage.master_dtype)
        if self.world_size > 1:
            flat.div_(self.world_size)  # average like DDP: divide first, then sum
        self.schedule.note("reduce", unit)
        label = f"of unit {unit.name!r}'s gradients"
        if storage.world_size > 1:
            pending = collectives.reduce_scatter(flat, self.group, self.stats, async_op=True,
                                                 label=f"reduce-scatter {label}")
        elif self.world_size > 1:
            pending = collectives.all_reduce(flat, self.group, self.stats, async_op=True, label=f"all-reduce {label}")
        else:
            pending = Pending(None, flat, self.stats)
        self._pending.append((unit, pending, used))
        while len(self._pending) > MAX_PENDING_REDUCTIONS:
            self._complete_oldest()

    def finish(self) -> None:
        """End of backward: reduce the units whose post-backward did not fire (inputs without grad, the root),
        then wait for every reduction and hand the gradient shards to the shard parameters."""
        for unit in self.units:
            self.reduce(unit)
        while self._pending:
            self._complete_oldest()
        self._done.clear()
        reduced, self._reduced = self._reduced, []
        if not reduced:
            return
        masks = [torch.zeros(len(unit.storage.slots), dtype=torch.uint8) for unit, _, _ in reduced]
        for mask, (_, _, used) in zip(masks, reduced):
            mask[used] = 1
        agreed = torch.cat(masks)
        if self.world_size > 1:
            collectives.agree(agreed, self.group, self.stats, label="agreement on the parameters used")
        for (unit, shard_grad, _), mask in zip(reduced, agreed.split([len(m) for m in masks])):
            unit.storage.accumulate_shard_grad(shard_grad, mask.nonzero().flatten().tolist())

    def abandon(self) -> None:
        """A backward that raised: wait for what is in flight (the collectives were issued), keep nothing."""
        for _, pending, _ in self._pending:
            pending.wait()
        self._pending.clear()
        self._reduced.clear()
        self._done.clear()

    def _complete_oldest(self) -> None:
        unit, pending, used = self._pending.pop(0)
        self._reduced.append((unit, pending.wait(), used))

    def first_nonfinite(self) -> Optional[Unit]:
        """The first unit with a non-finite gradient shard on any rank (all ranks get the same answer)."""
        finite = torch.tensor([float(unit.storage.grads_finite()) for unit in self.units])
        if self.world_size > 1:
            collectives.all_reduce(finite, self.group, self.stats, label="all-reduce of gradient finiteness",
                                   op=dist.ReduceOp.MIN).wait()
        if bool(finite.all()):
            return None
        return self.units[int((finite == 0).nonzero()[0])]
