"""The runtime of a sharded model: :class:`ShardRuntime` holds its parts, each given what it needs as it is built,
installs the hooks that drive them, and is the model's face to the rest (the strategy, checkpoints, tests).

    state             step_state.py          where the step is (a Phase), its scopes' depth; the transitions
    hooks             unit_hooks.py          each unit's forward and backward hooks, the end of backward
    scope             step_scope.py          a step: the root's scope, its start and its end
    entries           entries.py             calls entering the model below the root
    schedule          gather.py              all-gathers, prefetch along the recorded order, frees
    reducer           reduce.py              reduce-scatters, accumulation without sync
    elision           elision.py             which units backward needs gathered again
    held              held.py                every unit held gathered (keep_gathered)
    buffers           buffers.py             rank 0's buffers (DDP's broadcast_buffers)
    optimizers        optim/optimizer_attach.py  optimizers on the shards, their sharded steps
    norms             optim/norms.py         gradient norms over every rank's shards, clipping
    nonfinite_policy  nonfinite.py           a step with a non-finite gradient skipped or stopped, on every rank
    guards            guards.py              conversions and state_dict() of the sharded tree
    outside           storage/outside.py     a unit's parameters read from outside it
    figures           step_figures.py        the last step's communication figures

The parts read the step's state; they change it only through its transitions (step_state.py). No part reads
another's private attributes: what one needs of another is handed to it at construction.

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
from lightning_shard.engine.optim.norms import GradientNorms
from lightning_shard.engine.optim.optimizer_attach import OptimizerAttachment
from lightning_shard.engine.optim.optimizer_step import DEFAULT_STEP_GROUP_NUMEL, ShardedStep
from lightning_shard.engine.optim.step_watch import StepWatch
from lightning_shard.engine.runtime.autocast_casts import AutocastCasts
from lightning_shard.engine.runtime.backward_watch import refuse_unseen_gradients
from lightning_shard.engine.runtime.buffers import ModuleBuffers
from lightning_shard.engine.runtime.compile import run_eagerly
from lightning_shard.engine.runtime.elision import BackwardElision
from lightning_shard.engine.runtime.entries import ModelEntries
from lightning_shard.engine.runtime.gather import GatherSchedule
from lightning_shard.engine.runtime.guards import ModuleGuards
from lightning_shard.engine.runtime.held import HeldUnits
from lightning_shard.engine.runtime.nonfinite import NonfinitePolicy
from lightning_shard.engine.runtime.reduce import GradientReducer
from lightning_shard.engine.runtime.step_figures import StepFigures
from lightning_shard.engine.runtime.step_scope import StepScope
from lightning_shard.engine.runtime.step_state import StepState
from lightning_shard.engine.runtime.unit_hooks import UnitHooks
from lightning_shard.engine.storage.outside import OutsideReads
from lightning_shard.engine.storage.unit import Unit

# Set to 1 (the test suite does) to check on the CPU that every hand-over between streams is in place.
CHECK_STREAMS = "LIGHTNING_SHARD_CHECK_STREAMS"


class ShardRuntime:
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
        self.stats = CommStats()
        device = units[0].storage.device if units else torch.device("cpu")
        self.streams = streams_for(device, check=os.environ.get(CHECK_STREAMS) == "1")
        self.state = StepState()  # where the step is, how deep its scopes nest, what it keeps (step_state.py)
        self.autocast_casts = AutocastCasts(device.type)  # casts cached before a forward with grad (autocast_casts.py)
        self.figures = StepFigures(self.stats, self.streams)
        self.schedule = GatherSchedule(groups.shard, self.stats, prefetch, self.streams)
        self.elision = BackwardElision(units, self.schedule, elide_backward_gathers, groups.agreements,
                                       self.world_size, self.stats)
        # offload: the CPU steps each unit as its gradient lands, when armed (host_step.py)
        self.host_stepper = (HostStepper(units, self._forward_order) if units and all(u.storage.offloaded for u in units)
                             else None)
        self.reducer = GradientReducer(units, groups, reduce_dtype, self.stats, self.schedule, self.host_stepper)
        self._handles: list[Any] = []  # every hook's, removed by remove_hooks()
        self.undo: list[Callable[[], None]] = []  # restores what was wrapped at setup (activation checkpointing)
        self.norms = GradientNorms(units, root, groups.shard, self.stats, self.host_stepper)
        self.nonfinite_policy = NonfinitePolicy(nonfinite, units, self.reducer, self.state)
        self.buffers = ModuleBuffers(root, self.group, self.stats, self.world_size, broadcast_buffers)
        self.hooks = UnitHooks(self.state, units, root_unit, self.schedule, self.elision, self.reducer, self.stats,
                               self.autocast_casts, self.host_stepper, self.nonfinite_policy, self.norms.total_grad_norm,
                               self._handles)
        self.scope = StepScope(self.state, units, root_unit, groups, self.schedule, self.reducer, self.elision,
                               self.buffers, self.figures, self.hooks)
        self.held = HeldUnits(self.state, units, root_unit, self.schedule, self.buffers, self.group, self.stats,
                              self.world_size)
        reducer = self.reducer
        self.optimizers = OptimizerAttachment(
            units, groups, self.stats, root, self.host_stepper,
            before_step=lambda: refuse_unseen_gradients(units, reducer, "an optimizer step"))
        self.guards = ModuleGuards(root, units, self.undo)
        for unit in units:  # one rank, computing in the shard itself: nothing to free or reduce before backward ends
            unit.watches_backward_end = not (self.world_size == 1 and unit.storage.aliases_shard)
        self.entries = ModelEntries(root, root_unit, self.state, self.scope, self.hooks.follow_requires_grad) \
            if root_unit is not None else None
        self._install_hooks()
        self.outside = OutsideReads(units, self.hooks.gather_for_reader)  # lookups of shard parameters
        self.undo.append(self.outside.stop)
        self._handles.append(StepWatch(self).handle)  # before every optimizer step over these parameters

    def _install_hooks(self) -> None:
        # run eagerly even when reached from a compiled frame (compile.py): a graph break, not collectives traced
        eager, hooks, scope = run_eagerly, self.hooks, self.scope
        for unit in self.units:
            if unit is not self.root_unit:
                for member in unit.members:
                    self._handles.append(member.register_forward_pre_hook(
                        eager(lambda m, a, k, u=unit: hooks.pre_forward(u, a, k)), with_kwargs=True))
                    self._handles.append(member.register_forward_hook(
                        eager(lambda m, a, k, out, u=unit: hooks.post_forward(u, m, out)), with_kwargs=True))
        if self.root_unit is not None and self.entries is not None:
            hooks.watch_parameters(self.root_unit)
            self.entries.install(self._handles, eager)
        self._handles.append(self.root.register_forward_pre_hook(eager(lambda m, a: scope.enter_root())))
        self._handles.append(self.root.register_forward_hook(  # (always_call: raising, it runs in an except block)
            eager(lambda m, a, out: scope.exit_step(out, failed=sys.exc_info()[0] is not None)), always_call=True))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.hooks.forget_watched()
        for restore in reversed(self.undo):  # wrappers installed later come off first
            restore()
        self.undo.clear()

    @property
    def hooks_installed(self) -> bool:
        return bool(self._handles)

    # -- steps ----------------------------------------------------------------------------------------
    def run_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one ``*_step`` as the root's scope (step_scope.py)."""
        return self.scope.run_step(step, *args, **kwargs)

    @property
    def restage_each_step(self) -> bool:
        """Offload: staging copies made again at each step's first gathers (offload.py)."""
        return self.scope.restage_each_step

    @restage_each_step.setter
    def restage_each_step(self, value: bool) -> None:
        self.scope.restage_each_step = value

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

    @property
    def nonfinite(self) -> Optional[str]:
        """None, "skip" or "error": what a non-finite gradient does (nonfinite.py)."""
        return self.nonfinite_policy.mode

    @nonfinite.setter
    def nonfinite(self, mode: Optional[str]) -> None:
        self.nonfinite_policy.mode = mode

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken."""
        return self.state.steps_done

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite gradient (``nonfinite="skip"``)."""
        return self.nonfinite_policy.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        self.nonfinite_policy.skipped_steps = count

    @property
    def broadcast_buffers(self) -> bool:
        """DDP's ``broadcast_buffers`` (buffers.py)."""
        return self.buffers.broadcast

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.buffers.broadcast = value

    @property
    def last_step_stats(self) -> dict[str, float]:
        """The last step's communication figures (step_figures.py)."""
        return self.figures.total

    def no_sync(self) -> Any:
        """Accumulate unsharded gradients locally, without reduction (costs a full gradient per unit)."""
        return self.reducer.no_sync()

    def no_replica_sync(self) -> Any:
        """Accumulate with the reduce-scatters (gradients stay sharded) but without the all-reduce across replicas
        (``hybrid``, ``none``): the first backward outside all-reduces the sum (FSDP2's ``set_requires_all_reduce``)."""
        return self.reducer.no_replica_sync()

    # -- optimizers -----------------------------------------------------------------------------------
    def shaped_parameters(self) -> Any:
        """Inside, the model's parameters have their real shapes (meta placeholders): build optimizers here,
        then :meth:`attach_optimizer` them."""
        return self.optimizers.shaped_parameters()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, whole: bool = False,
                         step_group_numel: int = DEFAULT_STEP_GROUP_NUMEL) -> ShardedStep:
        """Give ``optimizer`` the shard parameters in place of placeholders, and its sharded step (``whole``:
        each parameter stepped whole on an owner rank, for optimizers that are not elementwise)."""
        return self.optimizers.attach(optimizer, whole, step_group_numel)

    def arm_host_step(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float] = None,
                      norm_type: float = 2.0, finish_in_forward: bool = False) -> bool:
        """Offload: step each unit on the CPU as its gradient lands in the next backward (engine/optim/host_step.py), for
        ``optimizer`` (attached, elementwise), whose ``step`` must follow that backward with nothing in between
        touching gradients, parameters or param groups, except ``clip_grad_norm_(its parameters, max_norm,
        norm_type)`` when ``max_norm`` is given. ``finish_in_forward``: ``step`` returns before every unit is stepped,
        and the next forward waits for each unit's step as it gathers it (reading the optimizer's state directly, not
        through ``state_dict()`` or the checkpoint functions, needs :meth:`wait_host_steps` first). Every rank must
        call it alike. Returns whether it is armed (not where nothing is offloaded, or the optimizer steps whole
        parameters)."""
        return self.optimizers.arm_host_step(optimizer, max_norm, norm_type, finish_in_forward,
                                             checks_nonfinite=self.nonfinite is not None)

    def step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
        """``optimizer.step(closure)`` for the sharded model (the optimizer must be attached), then
        :meth:`after_optimizer_step`."""
        loss = self.optimizers.step(optimizer, closure)
        self.after_optimizer_step()
        return loss

    def after_optimizer_step(self) -> None:
        """Close the step's communication figures; re-gather units still gathered (manual optimization)."""
        self.streams.writes(*(("shard", unit.name) for unit in self.units))  # the optimizer, on compute
        self.figures.close_part()
        self.state.optimizer_stepped()
        if self.state.graph_kept:  # the shards changed under the kept graph: it is done with
            self.hooks.free_after_backward()
        for unit in (u for u in self.units if u.read_outside and not u.is_gathered):  # kept for a reader's backward
            self.schedule.reshard(unit)
        self.refresh_gathered(stepped=True)

    def apply_nonfinite_policy(self) -> None:
        """Before an optimizer step (step_watch.py): all ranks agree whether any gradient shard is not finite (a
        non-finite loss makes them so), and skip the step together (the optimizer sees no gradient) or stop."""
        self.nonfinite_policy.apply()

    def wait_host_steps(self) -> None:
        """Offload armed with ``finish_in_forward``: wait until every unit's step is done (raises its error). Reading
        a unit's parameters waits for its own step; this is for what reads the optimizer's state directly."""
        if self.host_stepper is not None:
            self.host_stepper.finish()

    def _forward_order(self) -> list[Unit]:
        """The units as the next forward gathers them: the root's first, then as the last step ran them."""
        root = [self.root_unit] if self.root_unit is not None else []
        return root + [unit for unit in self.schedule.order if unit is not self.root_unit]

    # -- gradient norms: every rank must call these (one all-reduce) ----------------------------------
    def clip_grad_norm_(self, parameters: list[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm over all shards, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""
        return self.norms.clip_grad_norm_(parameters, max_norm, norm_type)

    def total_grad_norm(self, parameters: list[Tensor], norm_type: float = 2.0) -> Tensor:
        """The norm :meth:`clip_grad_norm_` would clip ``parameters`` by (every rank must call it)."""
        return self.norms.total_grad_norm(parameters, norm_type)

    def grad_norms(self, norm_type: float = 2.0) -> tuple[list[str], Tensor, Tensor]:
        """The names of the parameters that have a gradient, each one's gradient norm over all shards, and their
        total norm: Lightning's ``grad_norm(model, norm_type)`` on the unsharded model."""
        return self.norms.grad_norms(norm_type)

    @property
    def grad_norms_read(self) -> bool:
        """:meth:`grad_norms` was called."""
        return self.norms.grad_norms_read

    # -- the shards and buffers between steps ---------------------------------------------------------
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

    def adopt_rebound_shards(self) -> None:
        """Shard parameters given other tensors between steps (``p.data = ...``: a momentum teacher's update) hold
        their values in the shards again: before anything reads the shards (a gather does it itself; a checkpoint).
        Offload's steps still to come are done first."""
        self.wait_host_steps()
        for unit in self.units:
            unit.storage.adopt_rebound_shards()

    def sync_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm running statistics ...) on every rank, one broadcast per dtype: DDP's
        ``broadcast_buffers``, and one consistent copy for a checkpoint. Every rank must call it."""
        self.buffers.sync()

    def rank0_buffers(self, everywhere: bool = True) -> Any:
        """Rank 0's buffers in the module tree while the block runs, on every rank (``everywhere``) or rank 0 alone;
        every rank must enter it (buffers.py)."""
        return self.buffers.rank0(everywhere)

    def keep_gathered(self, modifier_rank: Optional[int] = None, units: Optional[list[Unit]] = None) -> Any:
        """Hold every unit gathered for a whole evaluation or generation loop (held.py): every rank must enter (one
        all-gather per unit); inside, forwards without gradients run no collective. Writes to the parameters inside
        are written back from ``modifier_rank`` on exit, and refused without it. ``units``: only these (the same on
        every rank)."""
        return self.held.keep_gathered(modifier_rank, units)

    def held_bytes(self) -> int:
        """Bytes per rank that :meth:`keep_gathered` adds while it holds every unit."""
        return self.held.held_bytes()

    # -- the sharded tree as a plain module (guards.py) -----------------------------------------------
    def install_guards(self) -> None:
        self.guards.install()

    def plain_state_dict(self) -> Any:
        """``state_dict()`` of the tree as it is: this rank's 1-D shards, or whatever the caller registered in
        their place (the checkpoint code, which gathers on every rank itself)."""
        return self.guards.plain_state_dict()

    @property
    def apply_checks(self) -> Any:
        """More reasons to refuse any conversion of the tree (the strategy's)."""
        return self.guards.apply_checks

    @apply_checks.setter
    def apply_checks(self, checks: Any) -> None:
        self.guards.apply_checks = checks
