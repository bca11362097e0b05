"""Per-rank peak memory of a sharded training step, predicted before running it.

    peak = parameter shards + optimizer state + buffers + root unit (gathered all step)
           + max( activations + gathered units + gradients in flight + gradient shards,   # forward/backward
                  gradient shards + optimizer step scratch )                              # optimizer step

Every term is counted, not guessed: unit sizes come from the same planner the strategy uses (padding
included); optimizer state and step scratch per parameter element from one step of the real optimizer on
a small tensor; activations (and backward temporaries) from one forward and backward of the model on the
meta device, which allocates nothing, with the chosen activation checkpointing applied. Gathered units and
gradients in flight follow the engine's bounds: ``1 + prefetch`` units gathered under ``full`` sharding, all
of them from forward to backward under ``grad_op``, at most ``MAX_PENDING_REDUCTIONS`` reductions.

CLI (the Hydra config's model, data and strategy): ``python -m lightning_shard.estimate [overrides]``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_shard.activation_checkpointing import (
    CheckpointSpec,
    checkpoint_targets,
    validate_activation_checkpointing,
    wrap_forward,
)
from lightning_shard.memory_tracker import LiveBytes
from lightning_shard.runtime import MAX_PENDING_REDUCTIONS
from lightning_shard.shard_module import validate_sharding
from lightning_shard.wrap import UnitSpec, plan_units

MiB = 2**20


@dataclass
class MemoryEstimate:
    """Bytes per rank at the peak of a training step, by kind."""

    params: int  # parameter shards (master dtype) and the root unit, which stays gathered all step
    optimizer_state: int
    buffers: int
    grads: int  # gradient shards, complete at the end of backward
    gathered: int  # other units gathered at once
    grads_in_flight: int  # unsharded gradients of the unit in backward, the root's, reductions in flight
    activations: int  # saved for backward plus backward temporaries (local batch)
    step_scratch: int  # temporaries of the optimizer step

    @property
    def peak(self) -> int:
        resident = self.params + self.optimizer_state + self.buffers
        backward = self.activations + self.gathered + self.grads_in_flight + self.grads
        return resident + max(backward, self.grads + self.step_scratch)

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "peak": self.peak}

    def table(self) -> str:
        rows = [f"  {name:<16} {value / MiB:10.1f} MiB" for name, value in self.as_dict().items()]
        return "\n".join(rows)


def estimate_memory(
    model: nn.Module,
    world_size: int,
    sharding: str = "full",
    units: Optional[Sequence[UnitSpec]] = None,
    unit_size: Optional[int] = None,
    prefetch: int = 1,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    step: Optional[Callable[[nn.Module, Any], Tensor]] = None,
    batch: Any = None,
    activation_checkpointing: CheckpointSpec = False,
) -> MemoryEstimate:
    """Predict one rank's peak memory for training ``model`` sharded over ``world_size`` ranks.

    ``model`` may live on any device, the meta device included; it is not modified. ``step(model, batch)``
    returns the loss of one local (per-rank) ``batch``; without it no activations are counted.
    ``optimizer`` is called like ``optimizer(params)``: an optimizer class or a ``functools.partial``.
    """
    validate_sharding(sharding)
    spec = validate_activation_checkpointing(activation_checkpointing)
    plans = plan_units(model, units=units, unit_size=unit_size)
    master = next((p.dtype for p in model.parameters()), torch.float32)
    param_dtype = param_dtype or master
    reduce_dtype = reduce_dtype or master
    b_master, b_param, b_reduce = (_size(d) for d in (master, param_dtype, reduce_dtype))
    ranks = world_size if sharding != "none" else 1
    aliases = ranks == 1 and param_dtype == master

    sizes = []  # (padded numel, shard numel, is root) per unit
    for plan in plans:
        numel = plan.numel()
        if numel:
            shard = math.ceil(numel / ranks)
            sizes.append((shard * ranks, shard, plan.members == [""]))
    shard_total = sum(s for _, s, _ in sizes)
    root_numel = sum(n for n, _, is_root in sizes if is_root)
    others = sorted((n for n, _, is_root in sizes if not is_root), reverse=True)

    if aliases:
        gathered = 0
    elif sharding == "full":
        gathered = sum(others[: 1 + prefetch]) * b_param
    else:  # grad_op keeps every unit gathered from its forward to its backward; none keeps them always
        gathered = sum(others) * b_param
    reductions = sorted(((n * b_reduce + (s * b_reduce if ranks > 1 else 0)) for n, s, _ in sizes), reverse=True)
    grads_in_flight = ((others[0] if others else 0) * b_param + root_numel * b_param
                       + sum(reductions[:MAX_PENDING_REDUCTIONS]))
    state_per_element, scratch_per_element = _optimizer_bytes_per_element(optimizer, master)
    return MemoryEstimate(
        params=shard_total * b_master + (0 if aliases else root_numel * b_param),
        optimizer_state=round(shard_total * state_per_element),
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        grads=shard_total * b_master,
        gathered=gathered,
        grads_in_flight=grads_in_flight,
        activations=activation_bytes(model, step, batch, param_dtype, plans, spec) if step is not None else 0,
        step_scratch=round(shard_total * scratch_per_element),
    )


def activation_bytes(model: nn.Module, step: Callable[[nn.Module, Any], Tensor], batch: Any,
                     param_dtype: torch.dtype, plans: Optional[list] = None,
                     activation_checkpointing: Any = False) -> int:
    """Peak bytes above the parameters during one forward and backward, run on the meta device."""
    shadow = meta_copy(model, param_dtype)
    if activation_checkpointing:
        plans = plans if plans is not None else plan_units(shadow)
        members = [[shadow.get_submodule(name) for name in plan.members] for plan in plans
                   if plan.members != [""] and plan.params]
        for _name, module in checkpoint_targets(shadow, members, activation_checkpointing):
            wrap_forward(module)
    for param in shadow.parameters():  # a gradient leaves at once: the engine reduces it, counted apart
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    meta_batch = _to_meta(batch)
    with LiveBytes() as live:
        live.track([*shadow.parameters(), *shadow.buffers(), *_tensors(meta_batch)])
        baseline = live.current()
        live.reset_peak()
        loss = step(shadow, meta_batch)
        loss.backward()
    return max(live.peak - baseline, 0)


def meta_copy(model: nn.Module, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device (nothing is allocated)."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in memo:
            continue
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        empty = torch.empty_like(tensor, device="meta", dtype=cast)
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    runtime = getattr(model, "_shard_runtime", None)
    if runtime is not None:
        raise ValueError("estimate_memory takes the model before sharding (it is sharded already).")
    return copy.deepcopy(model, memo)


def _optimizer_bytes_per_element(optimizer: Callable[..., torch.optim.Optimizer], dtype: torch.dtype
                                 ) -> tuple[float, float]:
    """State kept per parameter element, and the step's scratch per element, by one real step on a probe."""
    n = 4096
    probe = nn.Parameter(torch.zeros(n, dtype=dtype))
    probe.grad = torch.full((n,), 1e-3, dtype=dtype)
    opt = optimizer([probe])
    opt.step()  # creates the state
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, Tensor) and v.numel() == n)
    with LiveBytes() as live:
        live.track([probe, probe.grad, *[v for s in opt.state.values() for v in s.values()]])
        live.reset_peak()
        baseline = live.current()
        opt.step()
    return state / n, max(live.peak - baseline, 0) / n


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _tensors(tree: Any) -> list[Tensor]:
    from torch.utils._pytree import tree_flatten

    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


def _to_meta(tree: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: torch.empty_like(x, device="meta") if isinstance(x, Tensor) else x, tree)
