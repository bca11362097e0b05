"""Offload's optimizer step overlapped with backward: each offloaded unit stepped by the CPU as its gradient lands in
host memory, on a worker thread, while the device's backward goes on.

Armed (:meth:`HostStepper.arm`) before a backward whose gradients go straight to one elementwise optimizer's step:
the last micro-batch of a step, with nothing in between that reads or writes the gradients or parameters but
clipping by norm (Lightning's strategy decides this at setup; with the engine alone, ``runtime.arm_host_step``).
Then, per unit, as its reduced gradient shard lands::

    worker: accumulate it into the shard parameters' ``.grad``   (not the host's end of backward)
            step the unit's parameters        (the user's optimizer on them alone: elementwise, the same numbers)
            cast the stepped shard into its staging copy, and queue its copy to the device (offload.py)

What needs every unit first, clipping's global norm and the non-finite check, is decided once, at the end of
backward (:meth:`decide`). A unit stepped before that is stepped speculatively: its master shard and optimizer state
are copied first (the backups, for at most ``SPECULATIVE_SHARE`` of the optimizer's elements: host memory the
estimator counts), and a step the decision changes (the norm asks for clipping; a non-finite gradient that
``nonfinite`` skips or raises on) is undone from them, then stepped again with the clipped gradients, or not at all.
After the decision the remaining units are stepped with no backup, in the order the next forward needs them.
``optimizer.step()`` (:meth:`commit`) checks that nothing the steps read has changed since (the gradients, the param
groups, their hyperparameters): a change raises, never a silently different step. It waits for the worker, or, armed
with ``finish_in_forward``, returns with steps still to come: each unit's next gather waits for its own step (so the
next forward runs behind the worker, not after it), and what reads the optimizer's state or every unit waits for them
all (host_step_deferred.py).

"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_pre_hooks

from lightning_shard.engine.optim.host_step_deferred import DeferredSteps
from lightning_shard.engine.optim.host_step_state import (
    Arming,
    Backup,
    changed_since,
    copy_state,
    group_options,
    outside_params,
    written_outside,
)
from lightning_shard.engine.optim.host_worker import HostWorker
from lightning_shard.engine.optim.optimizer_step import _raw_step
from lightning_shard.engine.optim.step_plan import params_key
from lightning_shard.engine.optim.step_watch import StepWatch
from lightning_shard.engine.storage.unit import Unit

SPECULATIVE_SHARE = 0.5  # at most this share of the optimizer's elements stepped before the decision (backed up)


class HostStepper:
    """The overlapped host step of one runtime (see the module note)."""

    def __init__(self, units: list[Unit], forward_order: Callable[[], list[Unit]] = list) -> None:
        self.units = units
        self._forward_order = forward_order  # the units as the next forward gathers them (the last step's)
        self._by_index = dict(enumerate(units))  # by position: the optimizer's step knows units so (step.where)
        self._position = {id(unit): i for i, unit in enumerate(units)}
        self.device = units[0].storage.device if units else torch.device("cpu")
        self._worker = HostWorker(self.device)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.armed: Optional[Arming] = None
        self.deferred = DeferredSteps(self._worker, units)  # the units still to step after optimizer.step() returned
        self.speculate = True  # the last decision changed nothing: steps before the next one are likely to stand
        self.backup_bytes = self.peak_backup_bytes = 0  # host memory held by backups (now, and its high-water mark)
        # what it did, for tests and benchmarks: optimizer steps taken this way, of them those clipping changed; unit
        # steps taken speculatively (backed up), and of those undone by a decision
        self.overlapped_steps = self.clipped_steps = self.speculative_units = self.redone_units = 0

    # -- arming (the host, before the backward) -----------------------------------------------------
    def arm(self, step: Any, clip: Optional[tuple[float, float]], decides: bool, finish_in_forward: bool = False) -> bool:
        """Overlap the next backward with ``step``'s optimizer step (and, ``finish_in_forward``, the forward after it);
        False where it cannot (a parameter outside the offloaded units, an optimizer stepping whole parameters, step
        pre-hooks: they run at ``optimizer.step()``, after the units were stepped), and the step stays as it is."""
        self.finish()
        self.disarm()
        optimizer: Optimizer = step.optimizer
        if step.whole or not self.units or not all(unit.storage.offloaded and unit.storage.steps_overlapped
                                                   for unit in self.units):
            return False  # (a unit of several dtypes, or one not offloaded)
        if optimizer._optimizer_step_pre_hooks or any(not isinstance(getattr(hook, "__self__", None), StepWatch)
                                                      for hook in _global_optimizer_pre_hooks.values()):
            return False  # (not the runtime's own: it checks at the step what the decision checked already)
        step.agree_on_groups()  # (every rank arms at the same point) the groups the steps will see
        params: dict[int, list[list[nn.Parameter]]] = {}
        groups = optimizer.param_groups
        for g, group in enumerate(groups):
            for param in group["params"]:
                where = step.where.get(id(param))
                if where is None:
                    return False
                params.setdefault(where[0], [[] for _ in groups])[g].append(param)
        options = [group_options(group) for group in groups]
        if step.fused is not None:
            with step.fused():  # torch's fused kernel where the sharded step would choose it (fused_default.py)
                shadow = [group_options(group) for group in groups]
        else:
            shadow = [group_options(group) for group in groups]  # (their own copies: a step may not write options)
        total = sum(p.numel() for per_group in params.values() for ps in per_group for p in ps)
        self.armed = Arming(step, clip, decides, options, shadow, params_key(optimizer), params,
                             budget=int(total * SPECULATIVE_SHARE) if decides and self.speculate else 0,
                             defer=finish_in_forward)
        return True

    def armed_for(self, step: Any) -> bool:
        return self.armed is not None and self.armed.step is step

    def disarm(self) -> None:
        """Forget an arming whose step never came (a training step that returned no loss); undo what it stepped, and
        raise where that cannot be done."""
        if self.armed is not None:
            lost = self.cancel()
            if lost:
                raise RuntimeError(
                    "lightning_shard: the overlapped host step (offload) was abandoned before its optimizer step (armed"
                    f" again, or a failed backward).{_cannot_undo(lost)} Or set offload_overlap=False for steps that"
                    " can be abandoned.")

    # -- during backward ----------------------------------------------------------------------------
    def take(self, unit: Unit, reduced: Tensor, used: list[int]) -> bool:
        """A unit's reduced gradient shard is on its way to host memory (the reducer): the worker accumulates it
        and steps the unit. False where the host's end of backward must do it (some parameter of the unit got no
        gradient here: whether one did on another rank is known only then)."""
        armed, index = self.armed, self._position[id(unit)]
        if armed is None or index not in armed.params:
            return False
        if armed.decided:
            lost = self.cancel()
            raise RuntimeError(
                "lightning_shard: a second backward after the one armed for the overlapped host step (offload): its"
                f" steps used the first backward's gradients.{_cannot_undo(lost)} Arm before the last backward of a"
                " step only.")
        storage = unit.storage
        if not set(used) >= set(storage.trainable):
            return False

        armed.landings += 1

        def land() -> None:
            storage.await_host_grads()
            storage.accumulate_shard_grad(reduced, used)
            numel = storage.shard_numel
            if not armed.decides:
                self._queue(armed, index)
            elif numel <= armed.budget:
                armed.budget -= numel
                self._queue(armed, index, backup=True)

        self._worker.submit(land, ready=storage.host.grads_arrived)
        return True

    def landed(self) -> None:
        """The end of backward, before anything reads the gradients: every gradient given to the worker is in
        ``.grad``."""
        if self.armed is not None:
            try:
                self._worker.wait(lands_only=True)
            except BaseException:
                self.cancel()
                raise

    def decide(self, nonfinite: Union[bool, Callable[[], Any]],
               norm: Callable[[list[nn.Parameter], float], Tensor]) -> None:
        """At the end of backward (every rank): whether a gradient is not finite (``nonfinite()``: the first such
        unit on any rank, where ``nonfinite`` skips or raises: then nothing is stepped, the step's own check does the
        rest), clipping's norm over the optimizer's parameters (``norm(params, norm_type)``); then every unit not
        stepped yet is stepped; a speculative step the decision changes is undone and done again."""
        armed = self.armed
        if armed is None:
            return
        if nonfinite and nonfinite() is not None:
            self.speculate = False
            self.disarm()  # (every step taken before the decision was backed up)
            return
        changed = False
        if armed.clip is not None:
            max_norm, norm_type = armed.clip
            params = [p for group in armed.step.optimizer.param_groups for p in group["params"]]
            total = norm(params, norm_type)
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch's clip_grads_with_norm_
            if not bool(coefficient == 1.0):
                changed = True
                self.clipped_steps += 1
                self._worker.pause()
                try:
                    self._undo_speculation(armed)
                finally:
                    self._worker.resume()
                kept = [p for p in params if p.grad is not None]
                torch.nn.utils.clip_grads_with_norm_(kept, max_norm, total, foreach=True)
            armed.clip_total = total
        with self._worker.lock:  # (a speculative step starting now takes no backup: nothing will undo it)
            armed.decided = True
        self.speculate = not changed
        rank = {self._position[id(unit)]: r for r, unit in enumerate(self._forward_order())}
        self._worker.reorder(lambda index: rank.get(index, len(rank)))  # (the backlog: as the next forward needs it)
        for index in sorted(armed.params, key=lambda index: rank.get(index, len(rank))):
            if index not in armed.queued:
                self._queue(armed, index)

    def clipped(self, parameters: list[Tensor], max_norm: float, norm_type: float) -> Optional[Tensor]:
        """Clipping asked for after an armed backward: the norm the decision found and applied (the same on every
        rank), or None where nothing is armed."""
        armed = self.armed
        if armed is None:
            return None
        optimizer_params = [p for group in armed.step.optimizer.param_groups for p in group["params"]]
        shards = [armed.step.shard_of(p) for p in parameters]
        if (armed.clip is None or not armed.decided or (float(max_norm), float(norm_type)) != armed.clip
                or [id(p) for p in shards] != [id(p) for p in optimizer_params]):
            lost = self.cancel()
            raise RuntimeError(
                "lightning_shard: gradient clipping other than the one the overlapped host step was armed for"
                f" (offload; armed: {armed.clip}, asked: max_norm={max_norm}, norm_type={norm_type}, over"
                f" {len(parameters)} parameters): the optimizer's steps may have begun with other gradients."
                f"{_cannot_undo(lost)} Clip by norm over the optimizer's parameters with"
                " Trainer(gradient_clip_val=...), or set offload_overlap=False.")
        armed.clip_asked = True
        return armed.clip_total

    # -- the optimizer's step (the host) ------------------------------------------------------------
    def commit(self) -> bool:
        """``optimizer.step()`` after an armed backward: wait for every unit's step (armed ``finish_in_forward``: for
        none) and check that its inputs are unchanged (raises if not). False if no backward ran since the arming:
        the caller steps as usual."""
        armed = self.armed
        assert armed is not None
        if not armed.decided:
            self.disarm()
            return False
        try:
            if not armed.defer:  # (deferred: an error of a step, raised where that unit's step is waited for)
                self._worker.wait()
            with self._worker.lock:
                self.deferred.begin(armed)  # (not deferred: none left)
                started = list(armed.stepped)
            # the units not started step with the gradients there now: those started, with those there before (looked
            # at without waiting for the one stepping now: its step reads the gradients and writes none of them)
            with torch._C.DisableTorchFunctionSubclass():
                problem = changed_since(armed.step, armed.clip if not armed.clip_asked else None, armed.key,
                                        armed.options, [armed.stepped[i] for i in started])
        except BaseException:
            self.deferred.stop_waiting()
            self.cancel()
            raise
        if problem is not None:
            self.deferred.stop_waiting()
            lost = self.cancel()
            raise RuntimeError(
                f"lightning_shard: {problem} between the backward and the optimizer step, after the overlapped host"
                f" step (offload) had stepped with what was there before.{_cannot_undo(lost)} Change gradients, param"
                " groups and hyperparameters before the backward (or in the optimizer's closure), or set"
                " offload_overlap=False.")
        self._drop_backups(armed)
        self.armed = None
        self.overlapped_steps += 1
        return True

    def finish(self) -> None:
        """Wait for the units still to step after ``optimizer.step()`` returned (``finish_in_forward``); raises the
        worker's error (host_step_deferred.py)."""
        self.deferred.finish()

    def on_worker(self) -> bool:
        """Whether the caller runs on the worker's thread (inside a unit's step)."""
        return self._worker.on_worker()

    def cancel(self) -> list[str]:
        """Drop the arming: what was stepped speculatively is undone. Returns the units stepped without a backup,
        which cannot be (for the caller's error to say so: an error of its own, or the one on its way, is what the
        user must see). Raises an error of the worker's not raised yet."""
        armed, self.armed = self.armed, None
        if armed is None:
            return []
        self._worker.pause()  # (the steps not started are dropped with it)
        try:
            lost = [self._by_index[i].name for i in armed.stepped if i not in armed.backups]
            self._undo_speculation(armed)
        finally:
            self._worker.resume()
        self._worker.raise_error()
        return lost

    def abandon(self) -> None:
        """A backward failed (and is being recovered from): what the worker did with its gradients cannot be told
        apart from the earlier micro-batches' in ``.grad``, nor always undone: raise where it did anything."""
        armed = self.armed
        if armed is None:
            return
        landed = armed.landings
        lost = self.cancel()
        if landed:
            raise RuntimeError(
                "lightning_shard: a backward failed after offload's overlapped host step had taken some of its"
                f" gradients into `.grad`; they cannot be taken out again.{_cannot_undo(lost)} Resume from a"
                " checkpoint, or set offload_overlap=False to recover from failed backwards.")

    # -- the worker's side --------------------------------------------------------------------------
    def _queue(self, armed: Arming, index: int, backup: bool = False) -> None:
        armed.queued.add(index)
        self._worker.submit(lambda: self._step_unit(armed, index, backup), key=index)

    def _step_unit(self, armed: Arming, index: int, backup: bool) -> None:
        self._step_params(armed, index, backup)
        with self._worker.lock:
            armed.done.add(index)
            self.deferred.stepped(armed, index)

    def _step_params(self, armed: Arming, index: int, backup: bool) -> None:
        optimizer = armed.step.optimizer
        unit = self._by_index[index]
        per_group = armed.params[index]
        params = [p for ps in per_group for p in ps]
        if all(p.grad is None for p in params):  # frozen, or unused everywhere: the optimizer writes nothing of it
            return
        if backup and not armed.decided:
            saved = Backup(unit.storage.shard.clone(), {p: copy_state(optimizer.state.get(p)) for p in params})
            with self._worker.lock:
                if not armed.decided:  # (else nothing will undo the step: the backup is not kept)
                    self.speculative_units += 1
                    armed.backups[index] = saved
                    self.backup_bytes += saved.nbytes
                    self.peak_backup_bytes = max(self.peak_backup_bytes, self.backup_bytes)
        armed.stepped[index] = [(p, p.grad, p.grad._version if p.grad is not None else -1) for p in params]
        shadow = object.__new__(type(optimizer))  # the optimizer over this unit's parameters alone
        shadow.__dict__.update(optimizer.__dict__)
        groups = [g for g, ps in enumerate(per_group) if ps]
        shadow.param_groups = [{**armed.shadow[g], "params": per_group[g]} for g in groups]
        before, state_before = dict(shadow.__dict__), outside_params(optimizer.state)
        _raw_step(optimizer)(shadow)
        written = written_outside(shadow, before, groups, armed.shadow, state_before)
        written += [f"the gradient of {armed.step.names.get(id(p), 'a parameter')!r}"
                    for p, grad, version in armed.stepped[index] if grad is not None and grad._version != version]
        if written:
            raise RuntimeError(
                f"lightning_shard: {type(optimizer).__name__}'s step wrote outside its parameters' state"
                f" ({written[:4]}): offload's overlapped step runs it once per unit, and again where clipping redoes a"
                " step, so it would write that more than once. Keep such state in optimizer.state[param] (and the"
                " gradients as they are), or set offload_overlap=False.")
        unit.storage.host.stage_after_step(unit.storage, self._copy_stream)

    def _undo_speculation(self, armed: Arming) -> None:
        """Put back what the backed-up steps changed (the worker paused): those units are stepped again after the
        decision, and so are the speculative steps that had not started (taken off the worker's queue)."""
        optimizer = armed.step.optimizer
        for index, saved in armed.backups.items():
            if index in armed.stepped:
                storage = self._by_index[index].storage
                storage.shard.copy_(saved.shard)
                for param, state in saved.states.items():
                    if state is None:
                        optimizer.state.pop(param, None)
                    else:
                        optimizer.state[param] = state
                storage.host.forget_staging()
                del armed.stepped[index]
                armed.done.discard(index)
                self.redone_units += 1
        self._drop_backups(armed)
        armed.queued &= set(armed.stepped)
        armed.budget = 0

    def _drop_backups(self, armed: Arming) -> None:
        with self._worker.lock:
            for saved in armed.backups.values():
                self.backup_bytes -= saved.nbytes
            armed.backups.clear()


def _cannot_undo(lost: list[str]) -> str:
    return f" Units {lost[:4]} were stepped already, which cannot be undone." if lost else ""

