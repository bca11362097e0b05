"""A step is the root's scope: the root unit has no forward of its own in Lightning (``training_step`` is not
``forward``), so the strategy wraps each ``*_step`` in :meth:`StepScope.run_step`, and the root module's own forward
does the same when called outside a step. The root unit stays gathered from the start of a step until its backward
has finished, since backward begins with it. A step's start is where what the ranks agree on once a step is agreed
(the parameters they train, the buffers) and where the last step's leftovers are cleared.

Scopes open and close the step's state (step_state.py): a step's start, a nested call, its close."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from lightning_shard.engine.comm.groups import ShardGroups
from lightning_shard.engine.runtime.arguments import expects_backward, explain_mixed_dtype_on_cpu, in_backward
from lightning_shard.engine.runtime.backward_watch import refuse_unseen_gradients, watch_outputs
from lightning_shard.engine.runtime.buffers import ModuleBuffers
from lightning_shard.engine.runtime.elision import BackwardElision
from lightning_shard.engine.runtime.gather import GatherSchedule
from lightning_shard.engine.runtime.reduce import GradientReducer
from lightning_shard.engine.runtime.step_figures import StepFigures
from lightning_shard.engine.runtime.step_state import StepState
from lightning_shard.engine.runtime.unit_hooks import UnitHooks
from lightning_shard.engine.storage.unit import Unit


class StepScope:
    def __init__(self, state: StepState, units: list[Unit], root_unit: Optional[Unit], groups: ShardGroups,
                 schedule: GatherSchedule, reducer: GradientReducer, elision: BackwardElision, buffers: ModuleBuffers,
                 figures: StepFigures, hooks: UnitHooks) -> None:
        self.state = state
        self.units = units
        self.root_unit = root_unit
        self.groups = groups
        self.world_size = groups.world_size
        self.schedule = schedule
        self.reducer = reducer
        self.elision = elision
        self.buffers = buffers
        self.figures = figures
        self.hooks = hooks  # (what trains followed; a failed backward recovered from; the root's backward seen)
        self.driven = False  # run_step is in use: a bare root forward is not a step
        self.restage_each_step = True  # offload: staging copies made again at each step's first gathers (offload.py)

    def run_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one ``*_step`` as the root's scope (see the module note)."""
        self.driven = True
        self.enter_step(step=True)
        output, failed = None, True
        try:
            output = step(*args, **kwargs)
            failed = False
            return output
        except RuntimeError as err:
            explain_mixed_dtype_on_cpu(err, self.units)
            raise
        finally:
            self.exit_step(output, failed)

    def enter_root(self) -> None:
        """The root module's forward (or a call entering below it: entries.py) opens a scope: a step of its own where
        no one calls :meth:`run_step`."""
        self.enter_step(step=not self.driven)

    def enter_step(self, step: bool) -> None:
        """``step``: a training/eval step every rank runs (``run_step``, or a root forward where no one calls
        ``run_step``), not a forward outside the steps (a callback's sample on rank 0): only a step runs the
        ranks' agreements (the trainable parameters, the buffers), which every rank must join."""
        state = self.state
        if state.held and state.depth == 0:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "lightning_shard: a forward with gradients inside keep_gathered(): held units run no collective,"
                    " so their gradients would never be reduced. Leave keep_gathered() to train, or run this forward"
                    " under torch.no_grad() (evaluation, generation).")
            state.nest()
            return
        if state.depth == 0 and state.backward_running and not in_backward():
            self.hooks.recover_from_failed_backward()
        if state.depth == 0 and not state.backward_running:
            joined = step and self.groups.shard_size > 1  # every rank runs it: may agree at its end
            if not self.reducer.left_unreduced:
                refuse_unseen_gradients(self.units, self.reducer, "a step's start")
            # a previous step that ran no backward may have left units gathered: their data may be stale
            keep_storage, restage, awaits = state.graph_kept, self.restage_each_step, state.awaits_backward
            for unit in self.units:
                self.schedule.reshard(unit, keep_storage=keep_storage)
                if restage:
                    unit.storage.shards_changed()  # offload: copied from the master again, whatever wrote it since
                if not awaits:  # (a root call of model(model(x)), of model(a) + model(b))
                    unit.forget_calls()
                    unit.read_outside = unit.returned_parameters = False
            follow_requires_grad = self.hooks.follow_requires_grad
            for unit in self.units:
                follow_requires_grad(unit)
            if step and self.world_size > 1 and torch.is_grad_enabled():
                self.reducer.compare_trainable()  # (with whether work in the background failed on any rank)
            elif step and self.world_size == 1 and self.reducer.background is not None:
                if self.reducer.background.failed():  # one rank: nothing to agree on
                    self.reducer.background.raise_failure()
            if step:
                # DDP's broadcast_buffers: the next step starts from rank 0's buffers if this one may change them
                self.buffers.before_step(may_change=torch.is_grad_enabled() and self.reducer.sync_grads)
            if torch.is_grad_enabled():
                self.figures.training_forward()
            if self.root_unit is not None:
                self.schedule.gather(self.root_unit, exposed=True)
            self.schedule.start_forward()
            self.elision.start_forward()
            state.start_step(joined)
            return
        state.nest()

    def exit_step(self, output: Any, failed: bool = False) -> None:
        """``failed``: the step is raising (on this rank only, maybe): nothing is agreed, the error goes on."""
        state = self.state
        if state.depth == 0:  # its enter_step raised (the root's forward hook runs even so)
            return
        state.close()
        if state.depth > 0 or state.held:
            return
        self.elision.end_forward()
        self.schedule.record_order()
        if state.backward_running:
            return
        if not expects_backward(output):
            for unit in self.units:
                self.schedule.reshard(unit, keep_storage=state.graph_kept)
            if state.joined_by_all and not failed:  # (a backward compares them as it ends)
                self.schedule.compare_issued(self.groups.agreements)
            return
        state.await_backward()  # the next root call is no new step for the units' calls, whose backward is to come
        if self.root_unit is not None:  # gathered again should a backward begin after one freed it (retain_graph)
            root_unit, hooks = self.root_unit, self.hooks
            watch_outputs(output, lambda _: hooks.pre_backward(root_unit))
