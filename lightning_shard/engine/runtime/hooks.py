"""The runtime: module and autograd hooks that drive a unit through a step, one file per mechanism below.

Per unit, per step (``full`` sharding)::

    forward:   pre-forward  -> gather (gather.py)        post-forward -> free (not the root unit)
    backward:  pre-backward -> gather, unless elided (elision.py; outputs' gradient hook)
               post-backward -> reduce-scatter gradients (reduce.py), free (inputs' gradient hook)
    end of backward (autograd final callback): reduce what is left, wait for every reduction,
               hand the gradient shards to the shard parameters, free everything

Note: the root unit has no forward of its own in Lightning (``training_step`` is not ``forward``), so a
*step* is the root's scope (step_scope.py).

Note: every rank must run the same units in the same order, as with any FSDP: collectives are issued
from hooks, and their order is the order in which the hooks fire.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_shard.engine.comm.collectives import CommStats
from lightning_shard.engine.comm.groups import ShardGroups
from lightning_shard.engine.comm.streams import streams_for
from lightning_shard.engine.optim.host_step import HostStepper
from lightning_shard.engine.optim.norms import RuntimeNorms
from lightning_shard.engine.optim.optimizer_attach import OptimizerAttachment, RuntimeOptimizers
from lightning_shard.engine.optim.step_watch import StepWatch
from lightning_shard.engine.runtime.autocast_casts import AutocastCasts
from lightning_shard.engine.runtime.arguments import cast_floating, flatten_arguments, in_backward, needs_cast
from lightning_shard.engine.runtime.backward_watch import refuse_unseen_gradients, watch_inputs, watch_outputs
from lightning_shard.engine.runtime.compile import run_eagerly
from lightning_shard.engine.runtime.elision import BackwardElision
from lightning_shard.engine.runtime.entries import ModelEntries
from lightning_shard.engine.runtime.gather import GatherSchedule
from lightning_shard.engine.runtime.guards import ModuleGuards
from lightning_shard.engine.runtime.held import HeldUnits
from lightning_shard.engine.runtime.reduce import GradientReducer
from lightning_shard.engine.runtime.returned import keep_returned
from lightning_shard.engine.runtime.step_figures import StepFigures
from lightning_shard.engine.runtime.step_scope import StepScope
from lightning_shard.engine.storage.outside import OutsideReads
from lightning_shard.engine.storage.unit import Unit

# Set to 1 (the test suite does) to check on the CPU that every hand-over between streams is in place.
CHECK_STREAMS = "LIGHTNING_SHARD_CHECK_STREAMS"


class ShardRuntime(StepScope, HeldUnits, ModelEntries, RuntimeOptimizers, RuntimeNorms, ModuleGuards):
    def __init__(
        self,
        root: nn.Module,
        units: list[Unit],
        root_unit: Optional[Unit],
        groups: ShardGroups,
        reduce_dtype: Optional[torch.dtype] = None,
        prefetch: int = 1,
        nonfinite: Optional[str] = None,
        elide_backward_gathers: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        self.root = root
        self.units = units  # root unit last
        self.root_unit = root_unit
        self.groups = groups
        self.group = groups.world  # agreements, buffers; gathers and reductions use groups.shard / groups.replicate
        self.world_size = groups.world_size
        self.shard_group_ranks = groups.shard_ranks
        self.nonfinite = nonfinite  # None, "skip" or "error": what a non-finite gradient does
        self.steps_done = 0
        self.skipped_steps = 0
        self.stats = CommStats()
        device = units[0].storage.device if units else torch.device("cpu")
        self.streams = streams_for(device, check=os.environ.get(CHECK_STREAMS) == "1")
        self.autocast_casts = AutocastCasts(device.type)  # casts cached before a forward with grad (autocast_casts.py)
        self.figures = StepFigures(self.stats, self.streams)
        self.schedule = GatherSchedule(groups.shard, self.stats, prefetch, self.streams)
        self.elision = BackwardElision(units, self.schedule, elide_backward_gathers, groups.agreements,
                                       self.world_size, self.stats)
        self.reducer = GradientReducer(units, groups, reduce_dtype, self.stats, self.schedule)
        # offload: the CPU steps each unit as its gradient lands, when armed (host_step.py)
        self.host_stepper = (HostStepper(units, self._forward_order) if units and all(u.storage.offloaded for u in units)
                             else None)
        self.reducer.host_stepper = self.host_stepper
        self.restage_each_step = True  # offload: staging copies made again at each step's first gathers (offload.py)
        self._depth = 0  # nesting of steps / root forwards
        self._joined_by_all = False  # the step now running is run by every rank (_enter_step)
        self._final_callback_queued = False  # a backward is running
        # a create_graph=True backward ran: its graph reads the gathered buffers again (a penalty backpropagated with the
        # loss, or after it), so none is freed until an optimizer step (forwards in between gather the same values into
        # them); each backward until then reduces at its end only: the kept graph adds to a unit's gradients after the
        # unit's own backward
        self._backward_graph_kept = False
        self._handles: list[Any] = []
        self._watched: set[int] = set()  # ids of gathered parameters with a post-accumulate-grad hook
        self.broadcast_buffers = broadcast_buffers
        self._buffers_stale = False  # the ranks' buffers may differ (a training step updated them locally)
        self._steps_driven = False  # run_step is in use: a bare root forward is not a step
        self._held = False  # inside keep_gathered(): every unit gathered, forwards run no collective
        self.undo: list[Callable[[], None]] = []  # restores what was wrapped at setup (activation checkpointing)
        self.optimizers = OptimizerAttachment(units, groups, self.stats, root, self.host_stepper)
        self.optimizers.before_step = lambda: refuse_unseen_gradients(units, self.reducer, "an optimizer step")
        for unit in units:  # one rank, computing in the shard itself: nothing to free or reduce before backward ends
            unit.watches_backward_end = not (self.world_size == 1 and unit.storage.aliases_shard)
        self._install_hooks()
        self.outside = OutsideReads(units, self._gather_for_reader)  # lookups of shard parameters
        self.undo.append(self.outside.stop)
        self._handles.append(StepWatch(self).handle)  # before every optimizer step over these parameters

    @property
    def trace(self) -> Optional[list[tuple[str, str]]]:
        """Set to a list to record ``(collective, unit name)`` in issue order (tests)."""
        return self.schedule.trace

    @trace.setter
    def trace(self, value: Optional[list[tuple[str, str]]]) -> None:
        self.schedule.trace = value

    @property
    def order(self) -> list[Unit]:
        """The forward order of units on the last step."""
        return self.schedule.order

    def after_optimizer_step(self) -> None:
        """Close the step's communication figures; re-gather units still gathered (manual optimization)."""
        self.streams.writes(*(("shard", unit.name) for unit in self.units))  # the optimizer, on compute
        self.figures.close_part()
        self.steps_done += 1
        if self._backward_graph_kept:  # the shards changed under the kept graph: it is done with
            self._free_after_backward()
        for unit in (u for u in self.units if u.read_outside and not u.is_gathered):  # kept for a reader's backward
            self.schedule.reshard(unit)
        self.refresh_gathered(stepped=True)

    def _forward_order(self) -> list[Unit]:
        """The units as the next forward gathers them: the root's first, then as the last step ran them."""
        root = [self.root_unit] if self.root_unit is not None else []
        return root + [unit for unit in self.schedule.order if unit is not self.root_unit]

    def wait_host_steps(self) -> None:
        """Offload armed with ``finish_in_forward``: wait until every unit's step is done (raises its error). Reading
        a unit's parameters waits for its own step; this is for what reads the optimizer's state directly."""
        if self.host_stepper is not None:
            self.host_stepper.finish()

    @property
    def last_step_stats(self) -> dict[str, float]:
        """The last step's communication figures (step_figures.py)."""
        return self.figures.total

    def refresh_gathered(self, stepped: bool = False) -> None:
        """The shards were written (a load; ``stepped``: an optimizer step, which writes only the parameters that have
        a gradient: a frozen unit's copies stay as they are, offload moves nothing of it again): their copies are
        stale, and the units held gathered are gathered again."""
        stepper = self.host_stepper
        for unit in self.units:
            if stepped and stepper is not None and stepper.deferred.restages(unit):
                continue  # its step is still to come (finish_in_forward), and makes its copies itself
            if not stepped or any(p.grad is not None for p in unit.storage.shard_params):
                unit.storage.shards_changed()
        self.schedule.refresh(self.units)

    # -- accumulation -------------------------------------------------------------------------------
    def no_sync(self) -> Any:
        """Accumulate unsharded gradients locally, without reduction (costs a full gradient per unit)."""
        return self.reducer.no_sync()

    def no_replica_sync(self) -> Any:
        """Accumulate with the reduce-scatters (gradients stay sharded) but without the all-reduce across replicas
        (``hybrid``, ``none``): the first backward outside all-reduces the sum (FSDP2's ``set_requires_all_reduce``)."""
        return self.reducer.no_replica_sync()

    # -- hooks --------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        # run eagerly even when reached from a compiled frame (compile.py): a graph break, not collectives traced
        eager = run_eagerly
        for unit in self.units:
            if unit is not self.root_unit:
                for member in unit.members:
                    self._handles.append(member.register_forward_pre_hook(
                        eager(lambda m, a, k, u=unit: self._pre_forward(u, a, k)), with_kwargs=True))
                    self._handles.append(member.register_forward_hook(
                        eager(lambda m, a, k, out, u=unit: self._post_forward(u, m, out)), with_kwargs=True))
        if self.root_unit is not None:
            self._watch_parameters(self.root_unit)
            self._install_root_unit_hooks(eager)
        self._handles.append(self.root.register_forward_pre_hook(
            eager(lambda m, a: self._enter_step(step=not self._steps_driven))))
        self._handles.append(self.root.register_forward_hook(  # (always_call: raising, it runs in an except block)
            eager(lambda m, a, out: self._exit_step(out, failed=sys.exc_info()[0] is not None)), always_call=True))

    def _watch_parameters(self, unit: Unit) -> None:
        """A gradient reaching the unit's gathered parameters says a backward began, where its outputs' hook may not (the
        root's, hooked as the step ends: a manual backward is inside it; no output needing a gradient; a kept graph)."""
        unit.parameters_watched = True
        for param in unit.storage.gathered_params:
            if param.requires_grad and id(param) not in self._watched:
                self._watched.add(id(param))
                self._handles.append(param.register_post_accumulate_grad_hook(self._start_backward))

    def _follow_requires_grad(self, unit: Unit) -> None:
        """Parameters frozen or unfrozen since the unit's last use (a fine-tuning callback between steps,
        ``toggle_optimizer`` inside one): its gathered parameters follow before they are computed with. The
        ranks compare what they train at each step's start (checked before its first reduction) and again in
        the agreement that ends each backward."""
        if unit.storage.sync_requires_grad() and unit.parameters_watched:
            self._watch_parameters(unit)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watched.clear()
        for restore in reversed(self.undo):  # wrappers installed later come off first
            restore()
        self.undo.clear()

    @property
    def hooks_installed(self) -> bool:
        return bool(self._handles)

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        self._follow_requires_grad(unit)
        self.autocast_casts.before_forward()
        if not self._held:
            self.schedule.gather(unit, exposed=not self._final_callback_queued)
            if not self._final_callback_queued:  # not a recomputation inside backward
                self.schedule.forward_reached(unit)
        cast = needs_cast(unit)
        watch = (unit.watches_backward_end and not self._held and torch.is_grad_enabled()
                 and not self._recomputing_for_saved_tensors(unit))
        arguments = None  # the arguments as they are
        if cast or watch:
            flat, rebuild = flatten_arguments(args, kwargs)
            changed = cast_floating(flat, unit.storage.param_dtype) if cast else flat
            if watch:
                changed = watch_inputs(unit, changed, self._post_backward)
            arguments = rebuild(changed) if changed is not flat else None
        unit.call_began = torch.autograd._get_sequence_nr()  # after the nodes made here: they are not the call's own
        return arguments

    def _gather_for_reader(self, unit: Unit) -> bool:
        """A module outside ``unit`` looked up one of its parameters: gathered where a step or a backward runs."""
        if self._held or not (self._depth > 0 or (self._final_callback_queued and in_backward())):
            return False
        self._follow_requires_grad(unit)
        self.schedule.gather(unit)
        unit.read_outside = True
        if unit.storage.trainable and not unit.parameters_watched:  # its gradient may be the backward's first
            self._watch_parameters(unit)
        return True

    def _recomputing_for_saved_tensors(self, unit: Unit) -> bool:
        """A call inside backward of a unit whose backward is still to come: a non-reentrant checkpoint
        recomputing saved tensors. Its graph is never run backward, so it gets no backward hooks."""
        return self._final_callback_queued and unit.backward_pending > 0

    def _post_forward(self, unit: Unit, module: nn.Module, output: Any) -> Any:
        if not unit.storage.aliases_shard:  # its gathered buffer is freed: what it returns of it is copied
            output, carries = keep_returned(output, unit.storage.gathered_ids)
            unit.returned_parameters |= carries
        if self._held:
            return output
        grad_enabled = torch.is_grad_enabled()
        order = self.schedule.order
        # backward starts with the last unit: freeing it now would only mean gathering it again at once (kept
        # whether or not elision would skip it: that is agreed only at the end of forward)
        keep_for_backward = grad_enabled and bool(order) and unit is order[-1]
        # a recomputation inside backward: the unit's backward follows at once and frees it
        recomputing = self._final_callback_queued
        if grad_enabled and self._depth == 0 and not recomputing:  # called outside any step (model(block(x))): the
            self._forward_awaits_backward = True  # next step's start is no new step for this call, its backward to come
        if (module is unit.members[-1] and not keep_for_backward and not recomputing and not unit.read_outside
                and (unit.reshard_after_forward or not grad_enabled)):
            self.schedule.reshard(unit, keep_storage=self._backward_graph_kept)
        if grad_enabled and not self._recomputing_for_saved_tensors(unit):
            if not watch_outputs(output, lambda _: self._pre_backward(unit), unit.call_began) \
                    and not unit.parameters_watched and unit.storage.trainable:
                self._watch_parameters(unit)
        return output

    def _pre_backward(self, unit: Unit) -> None:
        self._start_backward(None)
        if unit.reshard_after_forward and not self.elision.needs_backward_gather(unit) and not unit.is_gathered:
            if unit.inflight is None:
                self.stats.skipped_gathers += 1
                self.schedule.note("skip_gather", unit)
        else:
            self.schedule.gather(unit)
        if unit.reshard_after_forward:  # only then is there anything to gather ahead in backward
            self.schedule.backward_reached(unit, self.elision.needs_backward_gather)

    def _post_backward(self, unit: Unit) -> None:
        self._start_backward(None)  # (a backward through a unit's inputs only: a penalty's, an auxiliary loss's)
        if self._backward_graph_kept or torch.is_grad_enabled():  # (grad mode in backward: create_graph=True)
            return  # reduced, and freed, at the end of backward: a node of the kept graph may still read or add to it
        unit.backward_pending -= 1
        if unit.backward_pending > 0 or unit.unseen_backward or unit.read_outside:  # another call's backward may
            return  # still be running; or code outside the unit computed with it, to the end of backward (outside.py)
        self.schedule.reshard(unit)  # first: its gathered buffer is free before its gradients are flattened
        if not unit.returned_parameters:
            self.reducer.reduce(unit)

    def _start_backward(self, _param: Optional[Tensor]) -> None:  # also a post-accumulate-grad hook (_watch_parameters)
        if not self._final_callback_queued:
            self._final_callback_queued = True
            # what trains is what requires grad now, as autograd's own accumulation reads it: a pass since the
            # unit's forward may have frozen it for its own use and unfrozen it after (peft's disable_adapter())
            for unit in self.units:
                self._follow_requires_grad(unit)
            # before this backward adds to what no_sync() left (inside it, the intact marks stay)
            self.reducer.marks.forget_zeroed(keep=not self.reducer.sync_grads)
            self.schedule.start_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._final_callback_queued = self._forward_awaits_backward = False
        self.autocast_casts.backward_ended()
        self._backward_graph_kept |= torch.is_grad_enabled()  # create_graph=True: keep what its graph reads
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
                self.host_stepper.decide(self.nonfinite is not None and self.reducer.first_nonfinite,
                                         self.total_grad_norm)
        except BaseException:
            if self.host_stepper is not None:
                self.host_stepper.cancel()
            raise
        finally:  # after an error too
            for unit in self.units:
                unit.await_calls_again()
                if self._backward_graph_kept and not unit.parameters_watched:  # the next backward may reach them
                    self._watch_parameters(unit)  # through the kept graph only (a penalty backpropagated alone)
            self._free_after_backward(keep_storage=self._backward_graph_kept)

    def _free_after_backward(self, keep_storage: bool = False) -> None:
        """The tree holds the shard parameters again, with their gradients (what an optimizer must be given); a step's
        root stays gathered. ``keep_storage``: the gathered buffers stay allocated, for the kept graph to read."""
        self._backward_graph_kept = keep_storage
        for unit in self.units:
            if unit is not self.root_unit or self._depth == 0:
                self.schedule.reshard(unit, keep_storage or unit.read_outside)

    def _recover_from_failed_backward(self) -> None:
        """A backward raised (e.g. a caught out-of-memory) before its final callback ran: drop its partial
        gradients and in-flight reductions, so that the next step starts clean."""
        self._final_callback_queued = self._forward_awaits_backward = False
        self._backward_graph_kept = False
        self.reducer.abandon()
        if self.host_stepper is not None:
            self.host_stepper.abandon()
        for unit in self.units:
            unit.forget_calls()
            for param in unit.storage.gathered_params:
                param.grad = None
            unit.storage.unsharded.drop()
            self.schedule.reshard(unit)
