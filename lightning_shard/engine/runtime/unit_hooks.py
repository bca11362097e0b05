"""The hooks that drive each unit through a step: its forward's (gather; free after), its backward's (gather again,
unless elided; reduce its gradients, free), and the end of backward (autograd's final callback).

Per unit, per step (``full`` sharding)::

    forward:   pre-forward  -> gather (gather.py)        post-forward -> free (not the root unit)
    backward:  pre-backward -> gather, unless elided (elision.py; outputs' gradient hook)
               post-backward -> reduce-scatter gradients (reduce.py), free (inputs' gradient hook)
    end of backward (autograd final callback): reduce what is left, wait for every reduction,
               hand the gradient shards to the shard parameters, free everything

The step's state (step_state.py) is read here at every call and changed here where a backward begins and ends; a
step's scope, which holds the root unit gathered, is step_scope.py's.

Note: every rank must run the same units in the same order, as with any FSDP: collectives are issued
from hooks, and their order is the order in which the hooks fire.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_shard.engine.comm.collectives import CommStats
from lightning_shard.engine.runtime.arguments import cast_floating, flatten_arguments, in_backward, needs_cast
from lightning_shard.engine.runtime.autocast_casts import AutocastCasts
from lightning_shard.engine.runtime.backward_watch import watch_inputs, watch_outputs
from lightning_shard.engine.runtime.elision import BackwardElision
from lightning_shard.engine.runtime.gather import GatherSchedule
from lightning_shard.engine.runtime.nonfinite import NonfinitePolicy
from lightning_shard.engine.runtime.reduce import GradientReducer
from lightning_shard.engine.runtime.returned import keep_returned
from lightning_shard.engine.runtime.step_state import StepState
from lightning_shard.engine.storage.unit import Unit


class UnitHooks:
    def __init__(self, state: StepState, units: list[Unit], root_unit: Optional[Unit], schedule: GatherSchedule,
                 elision: BackwardElision, reducer: GradientReducer, stats: CommStats, autocast_casts: AutocastCasts,
                 host_stepper: Any, nonfinite_policy: NonfinitePolicy, total_grad_norm: Callable[..., Tensor],
                 handles: list[Any]) -> None:
        self.state = state
        self.units = units
        self.root_unit = root_unit
        self.schedule = schedule
        self.elision = elision
        self.reducer = reducer
        self.stats = stats
        self.autocast_casts = autocast_casts  # casts cached before a forward with grad (autocast_casts.py)
        self.host_stepper = host_stepper  # offload's overlapped step (host_step.py), or None
        self.nonfinite_policy = nonfinite_policy  # decided by that step at the end of backward, where it is armed
        self.total_grad_norm = total_grad_norm  # (norms.py) the same
        self.handles = handles  # the runtime's: removed with its hooks
        self._watched: set[int] = set()  # ids of gathered parameters with a post-accumulate-grad hook

    # -- parameters: what trains, and gradients that say a backward began ---------------------------
    def watch_parameters(self, unit: Unit) -> None:
        """A gradient reaching the unit's gathered parameters says a backward began, where its outputs' hook may not (the
        root's, hooked as the step ends: a manual backward is inside it; no output needing a gradient; a kept graph)."""
        unit.parameters_watched = True
        for param in unit.storage.gathered_params:
            if param.requires_grad and id(param) not in self._watched:
                self._watched.add(id(param))
                self.handles.append(param.register_post_accumulate_grad_hook(weakly(self.start_backward)))

    def follow_requires_grad(self, unit: Unit) -> None:
        """Parameters frozen or unfrozen since the unit's last use (a fine-tuning callback between steps,
        ``toggle_optimizer`` inside one): its gathered parameters follow before they are computed with. The
        ranks compare what they train at each step's start (checked before its first reduction) and again in
        the agreement that ends each backward."""
        if unit.storage.sync_requires_grad() and unit.parameters_watched:
            self.watch_parameters(unit)

    def forget_watched(self) -> None:
        """The runtime's hooks were removed (their handles with them)."""
        self._watched.clear()

    # -- forward --------------------------------------------------------------------------------------
    def pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        self.follow_requires_grad(unit)
        self.autocast_casts.before_forward()
        state = self.state
        held, backward_running = state.held, state.backward_running
        if not held:
            self.schedule.gather(unit, exposed=not backward_running)
            if not backward_running:  # not a recomputation inside backward
                self.schedule.forward_reached(unit)
        cast = needs_cast(unit)
        watch = (unit.watches_backward_end and not held and torch.is_grad_enabled()
                 and not (backward_running and unit.backward_pending > 0))  # (recomputing_for_saved_tensors, inline)
        arguments = None  # the arguments as they are
        if cast or watch:
            flat, rebuild = flatten_arguments(args, kwargs)
            changed = cast_floating(flat, unit.storage.param_dtype) if cast else flat
            if watch:
                changed = watch_inputs(unit, changed, self.post_backward)
            arguments = rebuild(changed) if changed is not flat else None
        unit.call_began = torch.autograd._get_sequence_nr()  # after the nodes made here: they are not the call's own
        return arguments

    def gather_for_reader(self, unit: Unit) -> bool:
        """A module outside ``unit`` looked up one of its parameters: gathered where a step or a backward runs."""
        state = self.state
        if state.held or not (state.depth > 0 or (state.backward_running and in_backward())):
            return False
        self.follow_requires_grad(unit)
        self.schedule.gather(unit)
        unit.read_outside = True
        if unit.storage.trainable and not unit.parameters_watched:  # its gradient may be the backward's first
            self.watch_parameters(unit)
        return True

    def recomputing_for_saved_tensors(self, unit: Unit) -> bool:
        """A call inside backward of a unit whose backward is still to come: a non-reentrant checkpoint
        recomputing saved tensors. Its graph is never run backward, so it gets no backward hooks."""
        return self.state.backward_running and unit.backward_pending > 0

    def post_forward(self, unit: Unit, module: nn.Module, output: Any) -> Any:
        if not unit.storage.aliases_shard:  # its gathered buffer is freed: what it returns of it is copied
            output, carries = keep_returned(output, unit.storage.gathered_ids)
            unit.returned_parameters |= carries
        state = self.state
        if state.held:
            return output
        grad_enabled = torch.is_grad_enabled()
        order = self.schedule.order
        # backward starts with the last unit: freeing it now would only mean gathering it again at once (kept
        # whether or not elision would skip it: that is agreed only at the end of forward)
        keep_for_backward = grad_enabled and bool(order) and unit is order[-1]
        # a recomputation inside backward: the unit's backward follows at once and frees it
        recomputing = state.backward_running
        if grad_enabled and state.depth == 0 and not recomputing:  # called outside any step (model(block(x))): the
            state.await_backward()  # next step's start is no new step for this call, its backward to come
        if (module is unit.members[-1] and not keep_for_backward and not recomputing and not unit.read_outside
                and (unit.reshard_after_forward or not grad_enabled)):
            self.schedule.reshard(unit, keep_storage=state.graph_kept)
        if grad_enabled and not (recomputing and unit.backward_pending > 0):  # (recomputing_for_saved_tensors)
            if not watch_outputs(output, lambda _: self.pre_backward(unit), unit.call_began) \
                    and not unit.parameters_watched and unit.storage.trainable:
                self.watch_parameters(unit)
        return output

    # -- backward -------------------------------------------------------------------------------------
    def pre_backward(self, unit: Unit) -> None:
        self.start_backward(None)
        if unit.reshard_after_forward and not self.elision.needs_backward_gather(unit) and not unit.is_gathered:
            if unit.inflight is None:
                self.stats.skipped_gathers += 1
                self.schedule.note("skip_gather", unit)
        else:
            self.schedule.gather(unit)
        if unit.reshard_after_forward:  # only then is there anything to gather ahead in backward
            self.schedule.backward_reached(unit, self.elision.needs_backward_gather)

    def post_backward(self, unit: Unit) -> None:
        self.start_backward(None)  # (a backward through a unit's inputs only: a penalty's, an auxiliary loss's)
        if self.state.graph_kept or torch.is_grad_enabled():  # (grad mode in backward: create_graph=True)
            return  # reduced, and freed, at the end of backward: a node of the kept graph may still read or add to it
        unit.backward_pending -= 1
        if unit.backward_pending > 0 or unit.unseen_backward or unit.read_outside:  # another call's backward may
            return  # still be running; or code outside the unit computed with it, to the end of backward (outside.py)
        if not self.state.held:  # (keep_gathered() holds it: an earlier graph's backward run inside the hold)
            self.schedule.reshard(unit)  # first: its gathered buffer is free before its gradients are flattened
        if not unit.returned_parameters:
            self.reducer.reduce(unit)

    def start_backward(self, _param: Optional[Tensor]) -> None:  # also a post-accumulate-grad hook (watch_parameters)
        if not self.state.backward_running:
            self.state.begin_backward()
            # what trains is what requires grad now, as autograd's own accumulation reads it: a pass since the
            # unit's forward may have frozen it for its own use and unfrozen it after (peft's disable_adapter())
            for unit in self.units:
                self.follow_requires_grad(unit)
            # before this backward adds to what no_sync() left (inside it, the intact marks stay)
            self.reducer.marks.forget_zeroed(keep=not self.reducer.sync_grads)
            self.schedule.start_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        state = self.state
        state.end_backward()  # (what awaited it is forgotten: its graph was the one awaited)
        self.autocast_casts.backward_ended()
        if torch.is_grad_enabled():  # create_graph=True: keep what its graph reads
            state.keep_graph()
        try:
            if self.host_stepper is not None and self.host_stepper.armed is not None:
                # units step as their reductions land, the last of them now: what code wrote into a copy still
                # gathered (the step's root, a unit read outside itself) is kept first (a write after this one, while
                # the units step, would be a stale copy's)
                for unit in self.units:
                    self.schedule.write_back(unit)
            self.reducer.finish()
            if self.host_stepper is not None:  # offload's overlapped step, where armed: what needs every unit
                self.host_stepper.landed()
                self.host_stepper.decide(self.nonfinite_policy.mode is not None and self.reducer.first_nonfinite,
                                         self.total_grad_norm)
        except BaseException:
            if self.host_stepper is not None:
                self.host_stepper.cancel()
            raise
        finally:  # after an error too
            for unit in self.units:
                unit.await_calls_again()
                if state.graph_kept and not unit.parameters_watched:  # the next backward may reach them
                    self.watch_parameters(unit)  # through the kept graph only (a penalty backpropagated alone)
            self.free_after_backward(keep_storage=state.graph_kept)

    def free_after_backward(self, keep_storage: bool = False) -> None:
        """The tree holds the shard parameters again, with their gradients (what an optimizer must be given); a step's
        root stays gathered. ``keep_storage``: the gathered buffers stay allocated, for the kept graph to read (else
        the kept graph, if any, is done with)."""
        if not keep_storage:
            self.state.drop_graph()
        if self.state.held:  # keep_gathered() holds every unit until it ends
            return
        for unit in self.units:
            if unit is not self.root_unit or self.state.depth == 0:
                self.schedule.reshard(unit, keep_storage or unit.read_outside)

    def recover_from_failed_backward(self) -> None:
        """A backward raised (e.g. a caught out-of-memory) before its final callback ran: drop its partial
        gradients and in-flight reductions, so that the next step starts clean."""
        self.state.end_backward()
        self.state.drop_graph()
        self.reducer.abandon()
        if self.host_stepper is not None:
            self.host_stepper.abandon()
        for unit in self.units:
            unit.forget_calls()
            for param in unit.storage.gathered_params:
                param.grad = None
            unit.storage.unsharded.drop()
            self.schedule.reshard(unit)


def weakly(method: Callable[..., Any]) -> Callable[..., None]:
    """``method`` called through a weak reference to its object: a hook autograd keeps on a tensor is held from C++,
    where the garbage collector cannot see it, so a strong one would keep the runtime, and through it the model and its
    optimizer state, alive for the rest of the process (a sweep's runs one after another)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook
