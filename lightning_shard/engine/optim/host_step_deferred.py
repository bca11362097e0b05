"""Offload's overlapped step after ``optimizer.step()`` returned (host_step.py, armed with ``finish_in_forward``): the
units the worker has not stepped yet, what waits for each of them, and what waits for them all.

Each such unit's shard waits for its own step (``HostMaster.await_step``): its gather, a prefetch of it, any use of its
shard parameters (their guard, engine/storage/offload.py), a direct read of its master shard; so the next forward runs
behind the worker. What reads the optimizer's state or every unit (checkpoints, the next arming, the next step, step
post-hooks) waits for them all (:meth:`DeferredSteps.finish`). Nothing on the way from the step to the forward may wait
for every unit, or nothing overlaps: the step's own check of the gradients does not wait for the unit stepping then
(host_step.py), the strategy's ``zero_grad`` after the step leaves the gradients of the units still to step to the
worker (:meth:`DeferredSteps.free_grads_after_step`), and a step's start reads only what the steps do not change
(``requires_grad``).
"""

from __future__ import annotations

import functools
from typing import Optional

from torch.optim import Optimizer

from lightning_shard.engine.optim.host_step_state import Arming
from lightning_shard.engine.optim.host_worker import HostWorker
from lightning_shard.engine.storage.unit import Unit


class DeferredSteps:
    """The units of one runtime still to step after their ``optimizer.step()`` returned (see the module note)."""

    def __init__(self, worker: HostWorker, units: list[Unit]) -> None:
        self._worker = worker
        self._by_index = dict(enumerate(units))
        self._position = {id(unit): i for i, unit in enumerate(units)}
        self.in_flight: Optional[Arming] = None  # the arming whose optimizer.step() returned with units to step
        self.deferred_units = 0  # unit steps finished after their optimizer.step() returned (tests, benchmarks)

    def begin(self, armed: Arming) -> None:
        """(The host, under the worker's lock, as ``optimizer.step()`` returns.) The units not stepped yet wait for
        their step from now on."""
        armed.pending = set(armed.queued) - armed.done
        armed.pending_at_commit = frozenset(armed.pending)
        for index in armed.pending:
            self._by_index[index].storage.host.await_step = functools.partial(self._await_unit, index)
        if armed.pending:
            self.in_flight = armed

    def stepped(self, armed: Arming, index: int) -> None:
        """(The worker, under its lock.) Unit ``index``'s step is over: nothing waits for it any more, and where
        ``optimizer.step()`` had returned before it, its end left this unit's copies (and its gradients, if the
        strategy frees them after the step) to the worker."""
        if index not in armed.pending:
            return
        armed.pending.discard(index)
        self._by_index[index].storage.host.stepped_late()
        self.deferred_units += 1
        if armed.free_grads:
            for param in (p for ps in armed.params[index] for p in ps):
                param.grad = None

    def finish(self) -> None:
        """Wait for the units still to step; raises the worker's error. (What those steps read cannot change before
        them: reading or writing a unit's shard parameters, their gradients included, waits for its step.)"""
        armed, self.in_flight = self.in_flight, None
        if armed is None:
            return
        try:
            self._worker.wait()
        finally:
            self._release(armed)

    def restages(self, unit: Unit) -> bool:
        """Whether ``unit``'s step was still to come as ``optimizer.step()`` returned: the worker makes its copies."""
        armed = self.in_flight
        return armed is not None and self._position[id(unit)] in armed.pending_at_commit

    def free_grads_after_step(self, optimizer: Optimizer) -> None:
        """``optimizer.zero_grad()`` right after its step (the strategy frees the gradients then), without waiting for
        the units still to step: the worker frees theirs once each is stepped (reading them waits until then)."""
        armed = self.in_flight
        own_zero_grad = type(optimizer).zero_grad is not Optimizer.zero_grad  # (which may read what it likes)
        if armed is None or armed.step.optimizer is not optimizer or own_zero_grad:
            optimizer.zero_grad()
            return
        with self._worker.lock:
            armed.free_grads = True
            stepping = set(armed.pending)
        where = armed.step.where
        for group in optimizer.param_groups:
            for param in group["params"]:
                if where.get(id(param), (None,))[0] not in stepping:
                    param.grad = None

    def stop_waiting(self) -> None:
        """An error raised: nothing waits for the units still to step any more."""
        armed, self.in_flight = self.in_flight, None
        if armed is not None:
            self._release(armed)

    def _await_unit(self, index: int) -> None:
        """Something other than the worker reads or writes unit ``index``'s shard: its step first."""
        armed = self.in_flight
        if armed is None or self._worker.on_worker():
            return
        try:
            self._worker.wait_for(lambda: index not in armed.pending)
            if index in armed.pending:  # nothing left to run it: dropped after an error raised before
                raise RuntimeError(f"lightning_shard: offload's overlapped step of unit {self._by_index[index].name!r}"
                                   " did not run (an earlier error of the step's); resume from a checkpoint.")
        except BaseException:
            self.stop_waiting()
            raise

    def _release(self, armed: Arming) -> None:
        """Nothing waits for ``armed``'s units any more (all stepped, or an error raised)."""
        with self._worker.lock:
            for index in armed.pending:
                self._by_index[index].storage.host.await_step = None
            armed.pending.clear()
