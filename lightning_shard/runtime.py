"""When units are gathered, freed and reduced: the forward/backward hooks and their state.

Per unit, per step (``full`` sharding)::

    forward:   pre-forward  -> gather            post-forward -> free (not the root unit)
    backward:  pre-backward -> gather (outputs' gradient hook)
               post-backward -> reduce-scatter gradients (async), free (inputs' gradient hook)
    end of backward (autograd final callback): reduce what is left, wait for every reduction,
               hand the gradient shards to the shard parameters, free everything

Note: the root unit has no forward of its own in Lightning (``training_step`` is not ``forward``), so a
*step* is the root's scope: the strategy wraps each ``*_step`` in :meth:`ShardRuntime.step`, and the
root module's own forward does the same when called outside a step. The root unit stays gathered from
the start of a step until its backward has finished, since backward begins with it.

Note: every rank must run the same units in the same order, as with any FSDP: collectives are issued
from hooks, and their order is the order in which the hooks fire.

Note: a unit's parameters are needed in backward only if autograd saved them (or a view of them) in
forward. A saved-tensor hook active during each step's forward records exactly which gathered buffers were
saved; a unit whose buffer was not (e.g. an embedding fed token ids: its backward needs only the indices)
is not all-gathered again in backward, and its gradient is still reduce-scattered. Recomputation under
activation checkpointing calls the unit's modules again, which gathers them like any forward.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_shard import collectives
from lightning_shard.collectives import CommStats, Pending
from lightning_shard.flat_shard import FlatShard


MAX_PENDING_REDUCTIONS = 2  # gradient reductions in flight at once: one overlapping the next unit's backward


class Unit:
    def __init__(self, name: str, members: list[nn.Module], storage: FlatShard, reshard_after_forward: bool):
        self.name = name
        self.members = members
        self.storage = storage
        self.reshard_after_forward = reshard_after_forward
        self.is_gathered = False  # gathered data valid and registered on the members
        self.inflight: Optional[Pending] = None  # a prefetch all-gather not yet waited for
        self.backward_pending = 0  # forward calls whose post-backward has not fired yet
        self.saved_for_backward = True  # autograd saved its gathered parameters in this step's forward
        self.checkpointed = False  # a module reading its parameters is recomputed in backward

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, numel={self.storage.padded_numel})"


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward has finished."""

    @staticmethod
    def forward(ctx, runtime: "ShardRuntime", unit: Unit, *inputs: Tensor):  # type: ignore[override]
        ctx.runtime, ctx.unit = runtime, unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        ctx.runtime._post_backward(ctx.unit)
        return (None, None) + grads


class ShardRuntime:
    def __init__(
        self,
        root: nn.Module,
        units: list[Unit],
        root_unit: Optional[Unit],
        group: Optional[dist.ProcessGroup],
        reduce_dtype: Optional[torch.dtype] = None,
        prefetch: int = 1,
        nonfinite: Optional[str] = None,
        elide_backward_gathers: bool = True,
    ) -> None:
        self.root = root
        self.units = units  # root unit last
        self.root_unit = root_unit
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.reduce_dtype = reduce_dtype
        self.prefetch = prefetch
        self.nonfinite = nonfinite  # None, "skip" or "error": what a non-finite gradient does
        self.steps_done = 0
        self.skipped_steps = 0
        self.stats = CommStats()
        self.last_step_stats: dict[str, float] = {}
        self.gathered_bytes = 0  # bytes of gathered buffers alive now (root included)
        self.peak_gathered_bytes = 0
        self.trace: Optional[list[tuple[str, str]]] = None  # (collective, unit) in issue order, for tests
        self._order: list[Unit] = []  # forward order of units recorded on the previous step
        self._current_order: list[Unit] = []
        self._forward_cursor = 0
        self._backward_cursor = 0
        self._warned_order_change = False
        self.sync_grads = True  # False while accumulating without reduction (see no_sync)
        self._depth = 0  # nesting of steps / root forwards
        self._final_callback_queued = False
        self._pending_reductions: list[tuple[Unit, Pending, list[int]]] = []
        self._handles: list[Any] = []
        self.undo: list[Callable[[], None]] = []  # restores what was wrapped at setup (activation checkpointing)
        self.elide_backward_gathers = elide_backward_gathers
        self._gathered_storage: dict[int, Unit] = {}  # data pointer of a gathered buffer -> its unit
        self._saved_hooks: Optional[Any] = None
        self._install_hooks()

    # -- gather / free ------------------------------------------------------------------------------
    def _launch_gather(self, unit: Unit) -> None:
        """Start the unit's all-gather without waiting for it."""
        if unit.is_gathered or unit.inflight is not None or unit.storage.aliases_shard:
            return
        storage = unit.storage
        self._trace("all_gather", unit)
        if not storage.is_allocated:  # a refresh (after an optimizer step) reuses its buffer
            self.gathered_bytes += storage.gathered_nbytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        unit.inflight = collectives.all_gather(
            storage.allocate(), storage.shard_for_gather(), self.group, self.stats, async_op=True,
            label=f"all-gather of unit {unit.name!r}",
        )

    def gather(self, unit: Unit) -> None:
        if unit.is_gathered:
            return
        self._launch_gather(unit)
        if unit.inflight is not None:
            unit.inflight.wait()
            unit.inflight = None
        unit.storage.use_gathered()
        unit.is_gathered = True
        if not unit.storage.aliases_shard:
            self._gathered_storage[unit.storage.gathered.untyped_storage().data_ptr()] = unit

    def reshard(self, unit: Unit) -> None:
        if unit.inflight is not None:  # never free a buffer a collective is still writing
            unit.inflight.wait()
            unit.inflight = None
        if unit.is_gathered:
            unit.storage.use_shards()
            unit.is_gathered = False
            self._gathered_storage.pop(unit.storage.gathered.untyped_storage().data_ptr(), None)
        if unit.storage.is_allocated and not unit.storage.aliases_shard:
            self.gathered_bytes -= unit.storage.gathered_nbytes
            unit.storage.free()

    def _prefetch_after(self, unit: Optional[Unit], order: list[Unit], cursor: int, backward: bool = False) -> int:
        """Launch the gathers of the ``prefetch`` units that follow ``unit`` in ``order``; returns the new cursor.

        ``unit=None`` means the start of ``order``. A unit not found (the order changed) prefetches nothing.
        """
        if unit is None:
            position = -1
        else:
            try:
                position = order.index(unit, cursor)
            except ValueError:
                return cursor
        for upcoming in order[position + 1 : position + 1 + self.prefetch]:
            if not backward or self._needs_backward_gather(upcoming):
                self._launch_gather(upcoming)
        return position + 1

    def _trace(self, op: str, unit: Unit) -> None:
        if self.trace is not None:
            self.trace.append((op, unit.name))

    # -- steps (the root's scope) -------------------------------------------------------------------
    def run_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one ``*_step`` as the root's scope (see the module note)."""
        self._enter_step()
        output = None
        try:
            output = step(*args, **kwargs)
            return output
        finally:
            self._exit_step(output)

    def _enter_step(self) -> None:
        if self._depth == 0 and not self._final_callback_queued:
            # a previous step that ran no backward may have left units gathered: their data may be stale
            for unit in self.units:
                self.reshard(unit)
                unit.backward_pending = 0
            if self.root_unit is not None:
                self.gather(self.root_unit)
            self._current_order = []
            self._forward_cursor = self._prefetch_after(None, self._order, 0)
            if self.elide_backward_gathers:
                for unit in self.units:
                    unit.saved_for_backward = False
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
                self._saved_hooks.__enter__()
        self._depth += 1

    def _exit_step(self, output: Any) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        self._record_order()
        if not self._final_callback_queued and not _expects_backward(output):
            for unit in self.units:
                self.reshard(unit)

    def _pack(self, tensor: Tensor) -> Tensor:
        """Saved-tensor hook: note the unit whose gathered buffer autograd keeps for backward."""
        unit = self._gathered_storage.get(tensor.untyped_storage().data_ptr()) if tensor.device.type != "meta" else None
        if unit is not None:
            unit.saved_for_backward = True
        # a detached alias, not the tensor itself: an op's own output saved as-is would form a reference cycle
        return tensor.detach() if not tensor.requires_grad or tensor.grad_fn is not None else tensor

    def _needs_backward_gather(self, unit: Unit) -> bool:
        # a unit whose gathered buffer is its shard moves no data to gather: nothing to skip there
        needed = (unit.saved_for_backward or unit.checkpointed or unit.storage.aliases_shard
                  or not self.elide_backward_gathers)
        return unit.reshard_after_forward and needed

    def _record_order(self) -> None:
        current, self._current_order = self._current_order, []
        if not current or current == self._order:
            return
        if self._order and not self._warned_order_change:
            self._warned_order_change = True
            warnings.warn(
                "lightning_shard: the order in which units run changed between steps; prefetching follows the"
                " newest order (results are unaffected, only the overlap of communication with compute)."
            )
        self._order = current

    def after_optimizer_step(self) -> None:
        """Close the step's communication figures; re-gather units still gathered (manual optimization),
        since the optimizer changed their shards."""
        self.last_step_stats = self.stats.as_dict()
        self.stats.reset()
        self.steps_done += 1
        self.refresh_gathered()

    def refresh_gathered(self) -> None:
        """Re-gather the units held gathered, after their shards changed (optimizer step, loading)."""
        for unit in self.units:
            if unit.is_gathered and not unit.storage.aliases_shard:
                unit.is_gathered = False
                self.gather(unit)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally, without reduction (costs a full gradient per unit)."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    # -- hooks --------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        for unit in self.units:
            if unit is self.root_unit:
                continue
            for member in unit.members:
                self._handles.append(
                    member.register_forward_pre_hook(
                        lambda m, a, k, u=unit: self._pre_forward(u, a, k), with_kwargs=True
                    )
                )
                self._handles.append(
                    member.register_forward_hook(
                        lambda m, a, k, out, u=unit: self._post_forward(u, m, out), with_kwargs=True
                    )
                )
            for param, slot in zip(unit.storage.gathered_params, unit.storage.slots):
                if slot.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_accumulated))
        if self.root_unit is not None:
            for param, slot in zip(self.root_unit.storage.gathered_params, self.root_unit.storage.slots):
                if slot.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_accumulated))
        self._handles.append(self.root.register_forward_pre_hook(lambda m, a: self._enter_step()))
        self._handles.append(
            self.root.register_forward_hook(lambda m, a, out: self._exit_step(out), always_call=True)
        )

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for restore in self.undo:
            restore()
        self.undo.clear()

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.gather(unit)
        if not self._final_callback_queued:  # not a recomputation inside backward
            self._current_order.append(unit)
            self._forward_cursor = self._prefetch_after(unit, self._order, self._forward_cursor)
        if not torch.is_grad_enabled() or self._recomputing_for_saved_tensors(unit):
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        # each tensor once: a module may test identity (`attn(h, h, h)` projects once when `query is key`)
        inputs = list({id(x): x for x in flat if isinstance(x, Tensor) and x.requires_grad}.values())
        if not inputs:  # nothing to hook: the final callback reduces this unit
            return args, kwargs
        unit.backward_pending += 1
        hooked = dict(zip(map(id, inputs), _PostBackward.apply(self, unit, *inputs)))
        return tree_unflatten([hooked.get(id(x), x) for x in flat], spec)

    def _recomputing_for_saved_tensors(self, unit: Unit) -> bool:
        """A call inside backward of a unit whose backward is still to come: a non-reentrant checkpoint
        recomputing saved tensors. Its graph is never run backward, so it gets no backward hooks."""
        return self._final_callback_queued and unit.backward_pending > 0

    def _post_forward(self, unit: Unit, module: nn.Module, output: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        # backward starts with the last unit: freeing it now would only mean gathering it again at once
        keep_for_backward = (grad_enabled and bool(self._order) and unit is self._order[-1]
                             and self._needs_backward_gather(unit))
        # a recomputation inside backward: the unit's backward follows at once and frees it
        recomputing = self._final_callback_queued
        if (module is unit.members[-1] and not keep_for_backward and not recomputing
                and (unit.reshard_after_forward or not grad_enabled)):
            self.reshard(unit)
        if grad_enabled and not self._recomputing_for_saved_tensors(unit):
            tensors = [x for x in tree_flatten(output)[0] if isinstance(x, Tensor) and x.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: self._pre_backward(unit), mode="any")
        return output

    def _pre_backward(self, unit: Unit) -> None:
        self._queue_final_callback()
        if unit.reshard_after_forward and not self._needs_backward_gather(unit) and not unit.is_gathered:
            if unit.inflight is None:
                self.stats.skipped_gathers += 1
                self._trace("skip_gather", unit)
        else:
            self.gather(unit)
        if unit.reshard_after_forward:  # only then is there anything to gather ahead in backward
            reverse = self._order[::-1]
            self._backward_cursor = self._prefetch_after(unit, reverse, self._backward_cursor, backward=True)

    def _on_grad_accumulated(self, _param: Tensor) -> None:
        self._queue_final_callback()

    def _post_backward(self, unit: Unit) -> None:
        unit.backward_pending -= 1
        if unit.backward_pending > 0:  # another call of this unit still runs its backward
            return
        self._reduce(unit)
        self.reshard(unit)

    def _queue_final_callback(self) -> None:
        if not self._final_callback_queued:
            self._final_callback_queued = True
            self._backward_cursor = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    # -- gradient reduction -------------------------------------------------------------------------
    def _reduce(self, unit: Unit) -> None:
        storage = unit.storage
        if not self.sync_grads or not storage.has_unsharded_grads():
            return
        flat, used = storage.take_unsharded_grads(self.reduce_dtype or storage.master_dtype)
        if self.world_size > 1:
            flat.div_(self.world_size)  # average like DDP: divide first, then sum
        self._trace("reduce", unit)
        if storage.world_size > 1:
            pending = collectives.reduce_scatter(flat, self.group, self.stats, async_op=True,
                                                 label=f"reduce-scatter of unit {unit.name!r}'s gradients")
        elif self.world_size > 1:
            pending = collectives.all_reduce(flat, self.group, self.stats, async_op=True,
                                             label=f"all-reduce of unit {unit.name!r}'s gradients")
        else:
            pending = Pending(None, flat, self.stats)
        self._pending_reductions.append((unit, pending, used))
        # each reduction in flight holds a unit's full gradient: bound them, or backward would hold the model's
        while len(self._pending_reductions) > MAX_PENDING_REDUCTIONS:
            self._complete_oldest_reduction()

    def _complete_oldest_reduction(self) -> None:
        unit, pending, used = self._pending_reductions.pop(0)
        unit.storage.accumulate_shard_grad(pending.wait(), used)

    def _finish_backward(self) -> None:
        self._final_callback_queued = False
        for unit in self.units:  # units whose post-backward did not fire (inputs without grad, root)
            self._reduce(unit)
        while self._pending_reductions:
            self._complete_oldest_reduction()
        if self.nonfinite is not None:
            self._check_finite()
        for unit in self.units:
            unit.backward_pending = 0
            if unit is not self.root_unit or self._depth == 0:
                self.reshard(unit)

    def _check_finite(self) -> None:
        """All ranks agree whether any gradient shard is not finite (a non-finite loss makes them so)."""
        finite = torch.tensor([float(unit.storage.grads_finite()) for unit in self.units])
        if self.world_size > 1:
            collectives.all_reduce(finite, self.group, self.stats, label="all-reduce of gradient finiteness",
                                   op=dist.ReduceOp.MIN).wait()
        if bool(finite.all()):
            return
        first = self.units[int((finite == 0).nonzero()[0])]
        if self.nonfinite == "error":
            raise FloatingPointError(
                f"lightning_shard: non-finite gradient at step {self.steps_done}, first in unit {first.name!r}."
            )
        for unit in self.units:  # "skip": the optimizer sees no gradient anywhere, on every rank
            unit.storage.clear_grads()
        self.skipped_steps += 1
        warnings.warn(f"lightning_shard: step {self.steps_done} skipped: non-finite gradient in unit {first.name!r}.")

    # -- norms --------------------------------------------------------------------------------------
    @property
    def grads_are_sharded(self) -> bool:
        return any(unit.storage.world_size > 1 for unit in self.units)

    @torch.no_grad()
    def clip_grad_norm_(self, parameters: list[Tensor], max_norm: float) -> Tensor:
        """Clip by the global norm over all shards, as ``torch.nn.utils.clip_grad_norm_`` on the full model."""
        grads = [p.grad for p in parameters if p.grad is not None]
        device = grads[0].device if grads else self.units[0].storage.shard.device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            sq += g.detach().float().pow(2).sum()
        if self.grads_are_sharded and self.world_size > 1:
            collectives.all_reduce(sq, self.group, self.stats, label="all-reduce of the gradient norm").wait()
        total_norm = sq.sqrt()
        clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(clip_coef.to(g.dtype))
        return total_norm


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


def _expects_backward(output: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, Tensor) and x.requires_grad for x in tree_flatten(output)[0]
    )
