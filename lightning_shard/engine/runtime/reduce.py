"""Gradient reduction: each unit's gradients reduce-scattered (async) once its backward is done, so every
rank keeps only the gradient of the shard it owns, averaged over ranks like DDP.

One reduction is in flight while the next unit's backward computes: each holds a unit's flattened gradient
until it completes (unbounded, they would hold the whole model's by the end of backward), and the next unit's
is flattened only once it has completed, so a rank holds at most one unit's gradients twice.

Hybrid sharding (and ``none``) adds a second stage: once a unit's reduce-scatter within its shard group has
completed, its gradient shard is all-reduced across the replicas (async, shard-sized), overlapping later units'
backward too. While accumulating (:meth:`GradientReducer.no_replica_sync`) the shards are summed into the shard
parameters' ``.grad``, not yet all-reduced (as DDP's ``no_sync`` leaves local gradients in ``.grad``, so that a
``zero_grad`` in between discards them as it would under DDP); the first backward outside takes them back out,
adds them to its own shard and all-reduces the sum.

At one rank (no shard group, no replicas) there is nothing to reduce (``FlatShard.hand_over_grads``): computing in the
master dtype, each gathered parameter's gradient becomes its shard's as autograd made it, at the end of backward;
computing in a lower one, a unit's gradients are cast in one flat copy as its backward ends. Offloaded units take
the general path, which copies each reduced gradient shard to the host as its reduction completes.

Which collectives run and which gradients count is never one rank's local view: every unit with trainable
parameters is reduced once per backward on every rank (a unit that got no gradient here contributes
zeros), and a parameter keeps ``grad=None`` only if it got no gradient on *any* rank, agreed by one small
all-reduce of the ranks' used-parameter masks at the end of backward (DDP's ``find_unused_parameters``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats, Pending
from lightning_shard.engine.comm.groups import ShardGroups
from lightning_shard.engine.comm.streams import Streams
from lightning_shard.engine.runtime.gather import GatherSchedule, different_gathers
from lightning_shard.engine.runtime.no_sync_marks import NoSyncMarks
from lightning_shard.engine.storage.unit import Unit

MAX_PENDING_REDUCTIONS = 1  # overlapping the next unit's backward


class BackgroundWork(Protocol):
    """Work a rank runs beside training (a checkpoint written in the background: checkpoint/async_save.py), whose
    failure the ranks learn together: each rank's :meth:`failed` rides on a step's first agreement, and where any rank's
    did, every rank calls :meth:`raise_failure` at the same point of that step."""

    def failed(self) -> bool:
        """This rank's work has failed (no wait, no collective)."""

    def raise_failure(self) -> None:
        """Some rank's work failed: raise, naming it (after this rank's own work has ended)."""


@dataclass
class _Reduction:
    """One unit's gradients on their way to its shard parameters."""

    unit: Unit
    pending: Pending  # the collective in flight (reduce-scatter, then the all-reduce across replicas)
    used: list[int]  # slots that got a gradient on this rank (then: on any rank, and in any backward carried here)
    serial: int  # numbers its buffers for the stream checker (a unit may reduce twice)
    deferred: bool = False  # summed into .grad, all-reduced across replicas by a later backward (no_replica_sync)
    taken: bool = False  # handed to offload's overlapped step (host_step.py), which puts it in .grad itself
    # the sums of earlier micro-batches taken out of .grad to go with it (flat, slots held, slots unsynced): put back
    # if this backward fails
    carried: Optional[tuple[Tensor, list[int], set[int]]] = None


class GradientReducer:
    def __init__(self, units: list[Unit], groups: ShardGroups, reduce_dtype: Optional[torch.dtype],
                 stats: CommStats, schedule: GatherSchedule, host_stepper: Any = None) -> None:
        self.units = units
        self.groups = groups
        self.group = groups.world  # finiteness (device flags)
        self.agreements = groups.agreements  # host values: no device sync
        self.world_size = groups.world_size
        self.reduce_dtype = reduce_dtype
        self.stats = stats
        self.schedule = schedule  # for its trace
        self.streams: Streams = schedule.streams
        self.sync_grads = True  # False while accumulating without reduction (see no_sync)
        self.sync_replicas = True  # False while accumulating without the all-reduce across replicas
        self._pending: list[_Reduction] = []  # reduce-scatters in flight
        self._replicating: list[_Reduction] = []  # all-reduces across replicas in flight
        self._reduced: list[_Reduction] = []  # waiting for the ranks' agreed used-mask
        # id(unit) -> the slots whose shard parameter's .grad holds sums not yet all-reduced across replicas
        self._unsynced: dict[int, set[int]] = {}
        # ids of units that trained in a backward inside no_sync(): their gathered parameters may hold gradients,
        # frozen since or not, which the next backward outside reduces (plain torch keeps and steps them)
        self._accumulated: set[int] = set()
        # what no_sync() left unreduced, marked on the shard parameters' .grad for a zero_grad to clear, as DDP's
        self.marks = NoSyncMarks(units, self.agreements, self.world_size, stats)
        self._reductions = 0  # numbers each reduction's buffers for the stream checker (a unit may reduce twice)
        self._done: set[int] = set()  # ids of units reduced in this backward
        self._trainable_check: Optional[Pending] = None  # the ranks' comparison of what they train, in flight
        self._handed: list[Unit] = []  # one rank: units whose gradients go to their shards as they are, at the end
        self.left_unreduced = False  # the last backward ran inside no_sync(): the gathered parameters hold gradients
        self.host_stepper = host_stepper  # offload's overlapped step (host_step.py): takes gradients as they land
        self.background: Optional[BackgroundWork] = None  # checked with the parameters to train, at a step's start

    @property
    def in_flight(self) -> bool:
        """Reductions begun and not yet handed to the shard parameters (only inside a backward)."""
        return bool(self._pending or self._replicating or self._reduced or self._handed)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally, without reduction (costs a full gradient per unit)."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    @contextmanager
    def no_replica_sync(self) -> Iterator[None]:
        """Reduce-scatter within the shard group as usual (gradients stay at 1/G), but sum the shards locally and
        leave the all-reduce across replicas to the first backward outside (hybrid sharding's accumulation)."""
        previous, self.sync_replicas = self.sync_replicas, False
        try:
            yield
        finally:
            self.sync_replicas = previous

    def reduce(self, unit: Unit, sweep: bool = False) -> None:
        """Start reducing the unit's gradients (a unit's post-backward; ``sweep``: the end of backward, for
        units not reduced yet). A unit called twice whose post-backward fires twice reduces twice."""
        storage = unit.storage
        if sweep and id(unit) in self._done:
            return
        if not self.sync_grads:  # no_sync: summed where they are, in the reduction's dtype (unsharded_grads.py)
            if storage.trainable:
                self._accumulated.add(id(unit))
                dtype = self.reduce_dtype or storage.master_dtype
                # summed apart only in a reduction dtype finer than the compute's: a coarser one (fp32 compute,
                # reduce_dtype=bf16) sums in the fp32 .grad and casts once at the reduction, as DDP and FSDP2
                if torch.finfo(dtype).eps < torch.finfo(storage.param_dtype).eps:
                    self._done.add(id(unit))
                    storage.unsharded.hold(dtype)
                self.marks.mark(unit)
            return
        carried = id(unit) in self._accumulated or (self.sync_replicas and id(unit) in self._unsynced)
        if not (storage.trainable or carried):  # (the same on every rank: what they train is checked)
            return
        self.check_trainable()
        self._done.add(id(unit))
        self._accumulated.discard(id(unit))
        if self.world_size == 1 and not storage.offloaded:  # nothing to reduce, nowhere to move
            if storage.aliases_shard:  # its gradients become the shards' as they are, at the end
                self._handed.append(unit)
            else:  # cast to the reduce dtype now, in one flat copy: the unit's unsharded gradients are freed at once
                storage.hand_over_grads(self.reduce_dtype or storage.master_dtype)
            return
        while len(self._pending) >= MAX_PENDING_REDUCTIONS:  # before this unit's flattened copy is allocated
            self._complete_oldest()
        streams, serial = self.streams, self._reductions
        self._reductions += 1
        streams.writes(("grads", serial))  # backward wrote them on compute
        streams.handover("compute", "reduce")
        with streams.on("reduce"):  # its temporaries are allocated, and freed, in the reduce stream's order
            streams.reads(("grads", serial))
            flat, used, grads = storage.unsharded.take(self.reduce_dtype or storage.master_dtype)
            if self.world_size > 1:
                flat.div_(self.world_size)  # average like DDP: divide first, then sum
            self.schedule.note("reduce", unit)
            if storage.world_size > 1:
                pending = collectives.reduce_scatter(flat, self.groups.shard, self.stats, async_op=True,
                                                     label=f"reduce-scatter of unit {unit.name!r}'s gradients")
            else:
                pending = Pending(None, flat, self.stats)
        # the gradients were allocated on compute and read (flattened) on reduce: freed once compute has waited for
        # that read, not for the collective, so that a unit's unsharded gradients do not outlive their copy
        streams.handover("reduce", "compute")
        streams.writes(("grads", serial))
        del grads
        self._pending.append(_Reduction(unit, pending, used, serial))
        if storage.world_size == 1:  # nothing to reduce-scatter: on to the replicas at once
            self._complete_oldest()

    def compare_trainable(self) -> None:
        """Start comparing the parameters the ranks train (a step's start, before anything is reduced): which units
        are reduced depends on it. Checked before the step's first reduction, so a rank that froze something
        the others train is an error there, not mismatched collectives."""
        self.check_trainable()  # a step that ran no backward left its comparison unchecked
        trained = self._trained()
        failed = int(self.background is not None and self.background.failed())  # the same collective: no extra cost
        self._trainable_check = collectives.start_agreement(
            torch.tensor([trained, -trained, failed]), self.agreements, self.stats,
            label="agreement on the parameters to train")

    def check_trainable(self) -> None:
        if self._trainable_check is not None:
            high, low, failed = self._trainable_check.wait().tolist()
            self._trainable_check = None
            if failed and self.background is not None:
                self.background.raise_failure()
            if high != -low:
                raise _different_trainables()

    def _trained(self) -> int:
        return collectives.fingerprint([i for unit in self.units for i in (-1, *unit.storage.trainable)])

    def finish(self) -> None:
        """End of backward: reduce the units whose post-backward did not fire (inputs without grad, the root),
        then wait for every reduction and hand the gradient shards to the shard parameters."""
        self.left_unreduced = not self.sync_grads
        for unit in self.units:
            self.reduce(unit, sweep=True)
        for unit in self._handed:
            unit.storage.hand_over_grads(self.reduce_dtype or unit.storage.master_dtype)
        self._handed.clear()
        self._complete_all()
        self._done.clear()
        reduced, self._reduced = self._reduced, []
        if not reduced:
            if self.sync_grads and self.world_size > 1:  # nothing trains (a backward to the inputs): gathers only
                self.schedule.compare_issued(self.agreements)
            return
        # one flag per slot, in the units' fixed order: the same layout on every rank, whatever order the
        # reductions completed in (a Python list: a tensor op per unit would cost more than the flags)
        sizes = [len(unit.storage.slots) for unit in self.units]
        start = dict(zip(map(id, self.units), accumulate(sizes, initial=0)))
        used_anywhere = [0] * sum(sizes)
        for r in reduced:
            for i in r.used:
                used_anywhere[start[id(r.unit)] + i] = 1
        if self.world_size > 1:
            # the same collective also checks that the ranks train the same parameters (where one froze a
            # parameter the others train, its zeros were averaged in as a gradient), and that they reduced the
            # units in the same order (where a unit's backward ran on some ranks only, they summed unrelated
            # gradients)
            # and that they all-gathered the same units (gather.py: take_issued)
            order = collectives.fingerprint([self.units.index(r.unit) for r in reduced])
            trained, gathered = self._trained(), self.schedule.take_issued()
            checks = [trained, -trained, order, -order, gathered, -gathered]
            agreed = collectives.agree(torch.tensor(used_anywhere + checks, dtype=torch.int64), self.agreements,
                                       self.stats, label="agreement on the parameters used").tolist()
            used_anywhere, (high, low, order_high, order_low, gathered_high, gathered_low) = agreed[:-6], agreed[-6:]
            if gathered_high != -gathered_low:
                raise different_gathers()
            if high != -low:
                raise _different_trainables()
            if order_high != -order_low:
                raise RuntimeError(
                    "lightning_shard: ranks reduced the units' gradients in different orders, so they summed"
                    " unrelated gradients. A unit's backward ran on some ranks only (a loss term or a unit used"
                    " on some ranks' data only); every rank must run the same units' backward."
                )
        for r in reduced:
            if not r.taken:
                r.unit.storage.await_host_grads()
        for r in reduced:
            first = start[id(r.unit)]
            flags = used_anywhere[first : first + len(r.unit.storage.slots)]
            used = [i for i, flag in enumerate(flags) if flag]
            self.streams.reads(("reduced", r.serial))
            if r.taken:  # every parameter it holds had a gradient here: the same on every rank
                continue
            if r.deferred:
                if id(r.unit) not in self._unsynced:
                    # a gradient from before (no zero_grad since the last step) is the replicas' average already:
                    # the all-reduce that sums the replicas' .grad counts it once per replica (DDP divides it alike)
                    r.unit.storage.scale_grads(1 / self.groups.replicas)
                    self._unsynced[id(r.unit)] = set(r.unit.storage.trainable)
                self._unsynced[id(r.unit)].update(used)
            r.unit.storage.accumulate_shard_grad(r.pending.result, used)

    def abandon(self) -> None:
        """A backward that raised on every rank at the same point: wait for what is in flight (the collectives
        were issued everywhere), keep nothing. A rank-local failure cannot be recovered: the other ranks
        wait in their next collective until the process group timeout turns it into an error."""
        for r in self._pending + self._replicating:  # no new collective: what was issued everywhere completes
            with self.streams.on("reduce"):
                r.pending.wait()
            self.streams.handover("reduce", "compute")
        for r in self._pending + self._replicating + self._reduced:  # earlier micro-batches' sums go back to .grad
            if r.carried is not None:
                flat, held, unsynced = r.carried
                r.unit.storage.accumulate_shard_grad(flat, held)
                self._unsynced[id(r.unit)] = unsynced
        self._pending.clear()
        self._replicating.clear()
        self._reduced.clear()
        self._handed.clear()  # their gradients stay on the gathered parameters, which the caller clears
        self._done.clear()

    def _complete_oldest(self) -> None:
        """The oldest reduce-scatter has completed: add what earlier micro-batches left in ``.grad`` unsynced, then
        all-reduce across the replicas (or leave that to a later backward, or hand over when there are none)."""
        r = self._pending.pop(0)
        replicating = self.groups.replicas > 1 and self.sync_replicas
        carried = None
        with self.streams.on("reduce"):
            shard_grad = r.pending.wait()
            if self.sync_replicas and id(r.unit) in self._unsynced:
                unsynced = self._unsynced.pop(id(r.unit))
                carried = r.unit.storage.take_shard_grads(unsynced)
                if carried is not None:  # (held where the shard lives: host memory when offloaded)
                    shard_grad.add_(carried[0].to(device=shard_grad.device, dtype=shard_grad.dtype))
                    r.used = sorted(set(r.used) | set(carried[1]))
                    r.carried = (*carried, unsynced)
            if replicating:
                r.pending = collectives.all_reduce(shard_grad, self.groups.replicate, self.stats, async_op=True,
                                                   label=f"all-reduce across replicas of unit {r.unit.name!r}'s"
                                                   " gradients", across_replicas=True)
            else:
                r.deferred = self.groups.replicas > 1
                r.pending.result = r.unit.storage.grad_to_host(shard_grad)
                self.streams.writes(("reduced", r.serial))
                self._offer(r)
        if replicating:
            self._replicating.append(r)
            if carried is not None:  # the gradients taken (compute's memory) are freed once compute waited for the read
                self.streams.handover("reduce", "compute")
            return
        self.streams.handover("reduce", "compute")
        self._reduced.append(r)

    def _offer(self, r: _Reduction) -> None:
        """A gradient shard on its way to host memory, for offload's overlapped step to take as it lands."""
        if self.host_stepper is not None and not r.deferred:
            r.taken = self.host_stepper.take(r.unit, r.pending.result, r.used)

    def _complete_all(self) -> None:
        while self._pending:
            self._complete_oldest()
        for r in self._replicating:
            with self.streams.on("reduce"):
                r.pending.result = r.unit.storage.grad_to_host(r.pending.wait())
                self.streams.writes(("reduced", r.serial))
                self._offer(r)
            self.streams.handover("reduce", "compute")
            self._reduced.append(r)
        self._replicating.clear()

    def first_nonfinite(self) -> Optional[Unit]:
        """The first unit with a non-finite gradient shard on any rank (all ranks get the same answer)."""
        # on the shards' device (NCCL reduces device tensors only), read by the host once, after the all-reduce
        finite = torch.stack([unit.storage.grads_finite() for unit in self.units]).float()
        finite = finite.to(self.units[0].storage.device)  # offloaded: computed on the host
        if self.world_size > 1:
            collectives.all_reduce(finite, self.group, self.stats, label="all-reduce of gradient finiteness",
                                   op=dist.ReduceOp.MIN).wait()
        if bool(finite.all()):
            return None
        return self.units[int((finite == 0).nonzero()[0])]


def _different_trainables() -> RuntimeError:
    return RuntimeError(
        "lightning_shard: ranks train different parameters: `requires_grad` was changed on some ranks only."
        " Freeze or unfreeze parameters on every rank (a callback's hooks run on all of them)."
    )
