"""How the runtime sees a unit's backward begin and end: a hook on the node that made the unit's outputs (its
backward begins: gather) and a node on its inputs, whose backward runs once the unit's has finished (reduce its
gradients, free). A unit with nothing to free or reduce before the end of backward (one rank, the gathered buffer
is the shard: :attr:`Unit.watches_backward_end` false) gets no node on its inputs: its gradients are handed over,
and it is freed, when the whole backward ends. It keeps the hook on its outputs, which gathers it again wherever
something freed it before its backward (a nested backward's end, a forward under ``no_grad``).

Note: these are the engine's largest host cost per unit, so each is the cheapest autograd offers for the usual
call (one input, one output): the input passes through a ``split()`` into one view, whose C++ node gets a
post-hook, and the output's node gets a pre-hook. A Python ``autograd.Function`` costs twice that in forward and again in backward;
a tensor hook, a handle object and a dictionary more than a node's hook. Several inputs share one
``autograd.Function`` node, which runs once the backward of all of them is done.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Any, Callable

import torch
from torch import Tensor

from lightning_shard.engine.runtime.reduce import GradientReducer
from lightning_shard.engine.runtime.trees import output_leaves
from lightning_shard.engine.storage.unit import Unit

_GRAD = attrgetter("grad")


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward has finished."""

    @staticmethod
    def forward(ctx, on_end: Callable[[Unit], None], unit: Unit, *inputs: Tensor):  # type: ignore[override]
        ctx.on_end, ctx.unit = on_end, unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        ctx.on_end(ctx.unit)
        return (None, None) + grads


def watch_inputs(unit: Unit, flat: list, on_end: Callable[[Unit], None]) -> list:
    """``flat`` with its tensors that need a gradient passed through one identity node, whose backward calls
    ``on_end(unit)``; unchanged, and the unit marked as reduced at the end of backward, when there are none."""
    if unit.rearmed and torch._C._current_graph_task_id() == -1:  # a new forward after a backward: its calls count
        unit.forget_calls()
    if len(flat) == 1:  # a block's usual call
        inputs = [flat[0]] if isinstance(flat[0], Tensor) and flat[0].requires_grad else []
    else:  # each tensor once: a module may test identity (`attn(h, h, h)` projects once when `query is key`)
        inputs = list({id(x): x for x in flat if isinstance(x, Tensor) and x.requires_grad}.values())
    if not inputs:  # nothing to hook: the final callback reduces this unit
        unit.unseen_backward = unit.call_unwatched = True
        return flat
    unit.backward_pending += 1
    unit.calls_watched += 1
    if len(inputs) == 1 and inputs[0].dim() and inputs[0].layout == torch.strided:  # a block's usual call
        # a C++ view node and its hook. One split()'s view, not view_as(): written in place, a view_as() output would
        # drop the hooked node from the graph, and the unit's reduction would move to the end of backward on the ranks
        # that wrote it only (mismatched collectives); torch refuses in-place writes to split()'s views at once
        (watched,) = inputs[0].split_with_sizes([inputs[0].shape[0]])  # (Tensor.split is a Python wrapper of it)
        watched.grad_fn.register_hook(lambda _grad_inputs, _grad_outputs: on_end(unit))
        return [watched if x is inputs[0] else x for x in flat]
    hooked = dict(zip(map(id, inputs), _PostBackward.apply(on_end, unit, *inputs)))
    return [hooked.get(id(x), x) for x in flat]


def watch_outputs(output: Any, on_begin: Callable[[Any], None], call_began: int = -1) -> bool:
    """Call ``on_begin`` when the gradient of any of ``output``'s tensors that need one is computed; False if there
    is none. ``call_began``: the autograd sequence number when the call that made ``output`` began (``-1``: unknown)."""
    if isinstance(output, Tensor) and output.requires_grad and not output._is_view() and output.grad_fn is not None:
        output.grad_fn.register_prehook(on_begin)  # a block's usual output (runs when its gradient is complete)
        return True
    flat = [output] if isinstance(output, Tensor) else output_leaves(output)
    tensors = [_outlives_writes(x, call_began) for x in flat if isinstance(x, Tensor) and x.requires_grad]
    if len(tensors) == 1 and tensors[0].grad_fn is not None:
        tensors[0].grad_fn.register_prehook(on_begin)
    elif len(tensors) == 1:
        tensors[0].register_hook(on_begin)
    elif tensors:
        torch.autograd.graph.register_multi_grad_hook(list({id(x): x for x in tensors}.values()), on_begin, mode="any")
    return bool(tensors)


def _outlives_writes(output: Tensor, call_began: int) -> Tensor:
    """``output``, or for a view of a tensor the call made, that tensor: a caller's in-place write to a view replaces
    the view's autograd node, and drops its hooks, not its base's (a view's backward reads no parameter). A base made
    before the call (its input, returned as it came) has another unit's node: hooked, it would gather this unit after
    its backward."""
    if call_began >= 0 and output._is_view():
        base_node = output._base.grad_fn
        if base_node is not None and base_node._sequence_nr() >= call_began:
            return output._base
    return output


def refuse_unseen_gradients(units: list[Unit], reducer: GradientReducer, when: str) -> None:
    """Raise if a gathered parameter holds a gradient that no reduction took, or a reduction was not completed, ``when``
    neither may be (a step's start, an optimizer step): a backward reached them that no hook saw, or the last backward
    ran inside ``no_sync()``."""
    reducer.marks.forget_zeroed()  # (what no_sync() left, and a zero_grad cleared since, is gone)
    if reducer.in_flight:
        raise RuntimeError(f"lightning_shard: at {when}, gradient reductions begun in a backward were never completed:"
                           " the runtime did not see that backward begin. Please report the model's habit.")
    grads = set(map(_GRAD, chain.from_iterable(unit.storage.gathered_params for unit in units)))  # in C: every step
    held = [unit for unit in units if unit.storage.unsharded.held]  # summed in the reduction's dtype inside no_sync
    if held or (grads and grads != {None}):
        name = held[0].storage.slots[0].names[0] if held else next(
            slot.names[0] for unit in units for slot, param in zip(unit.storage.slots, unit.storage.gathered_params)
            if param.grad is not None)
        raise RuntimeError(
            f"lightning_shard: at {when}, {name!r} holds a gradient that was never reduced across ranks. Either a"
            " backward reached it only through a tensor its unit kept instead of returning it (`self.aux = ...`"
            " in forward, backpropagated on its own): return such a tensor from forward, or add it to a loss"
            " that also goes through the model's output; or the last backward before an optimizer step ran"
            " inside no_sync(): run it outside.")


def explain_freed_parameters(err: RuntimeError) -> None:
    """A backward that read a unit's parameters after the unit was freed gets torch's words for a storage of size 0.
    Say how that happens, and what to do (README, Limits)."""
    if "storage of size 0" in str(err):
        raise RuntimeError(
            "lightning_shard: backward read the parameters of a unit freed after its forward. A tensor computed inside"
            " the unit reached the loss without passing through the unit's outputs (an auxiliary loss kept on the"
            " module, `self.aux = head(out)`), so its backward ran before the hook on the unit's outputs gathered the"
            " unit again. Return that tensor from the unit's forward (as HF models return router logits), or train"
            " with sharding='grad_op'.") from err
