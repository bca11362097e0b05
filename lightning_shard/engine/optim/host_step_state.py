"""The state of offload's overlapped step (host_step.py): one armed backward (:class:`Arming`), and what one unit's step
reads and writes besides its parameters: the backup of its master shard and optimizer state taken before a speculative
step, and what the optimizer wrote elsewhere.

The overlapped step runs the user's optimizer once per unit, on that unit's parameters alone: the same numbers as
one call over every parameter only where the optimizer keeps all its state under its parameters
(``optimizer.state[param]``). A step count kept in the param group (timm's Adan) or in ``optimizer.state["k"]``
(MADGRAD's) would be advanced once per unit, and gradients written in place would be written again by a step redone
after clipping: :func:`written_outside` finds the former (host_step.py the latter), and the step refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_shard.engine.optim.step_plan import params_key


@dataclass(eq=False)
class Backup:
    """A unit's master shard and optimizer state before a speculative step."""

    shard: Tensor
    states: dict[nn.Parameter, Optional[dict]]

    @property
    def nbytes(self) -> int:
        tensors = [self.shard] + [v for s in self.states.values() if s for v in s.values() if isinstance(v, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(eq=False)
class Arming:
    """One armed backward (host_step.py): the optimizer, its groups' options as the steps use them, each unit's
    parameters, and how far the worker got."""

    step: Any  # the optimizer's ShardedStep
    clip: Optional[tuple[float, float]]  # (max_norm, norm_type) that clipping will be asked for, or None
    decides: bool  # clipping or the non-finite check: steps before the end of backward are speculative
    options: list[dict]  # each group's options (not its parameters) at arming: what the steps must still see
    shadow: list[dict]  # the groups as the steps run them (fused chosen where the step would choose it)
    key: tuple  # the optimizer's parameters at arming
    params: dict[int, list[list[nn.Parameter]]]  # unit index -> per group, the unit's parameters in it
    budget: int  # elements that may still be stepped speculatively
    defer: bool = False  # optimizer.step() may return before every unit is stepped (finish_in_forward)
    queued: set[int] = field(default_factory=set)  # units given to the worker to step
    stepped: dict[int, list[tuple[nn.Parameter, Optional[Tensor], int]]] = field(default_factory=dict)
    backups: dict[int, Backup] = field(default_factory=dict)
    decided: bool = False
    clip_asked: bool = False  # the clipping armed for was asked for (clipped())
    landings: int = 0  # gradients taken to land in .grad
    clip_total: Optional[Tensor] = None  # the norm the decision found (what the clipping call returns)
    done: set[int] = field(default_factory=set)  # units whose step is over (the worker's lock)
    pending: set[int] = field(default_factory=set)  # units still to step after optimizer.step() returned (the lock)
    pending_at_commit: frozenset[int] = frozenset()  # those as it returned: their copies are the worker's to make
    free_grads: bool = False  # the gradients are freed after the step: the worker frees those of the units in pending


def copy_state(state: Optional[dict]) -> Optional[dict]:
    if not state:
        return None
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}


def group_options(group: dict) -> dict:
    """A param group's options (not its parameters) as they are now: a tensor among them copied (an LR scheduler writes
    a tensor learning rate in place, ``fill_``, right after ``optimizer.step()``: a unit's step still to come then
    must not see it, nor a check see an in-place change as no change)."""
    return {k: _copied(v) for k, v in group.items() if k != "params"}


def _copied(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)) and any(isinstance(v, Tensor) for v in value):
        return type(value)(_copied(v) for v in value)  # (Adam's betas as tensors)
    return value


def outside_params(state: dict) -> dict:
    """The optimizer's state not kept under a parameter (``optimizer.state["k"]``), copied."""
    return {key: value.clone() if isinstance(value, Tensor) else value for key, value in state.items()
            if not isinstance(key, Tensor)}


def written_outside(shadow: Any, before: dict, groups: list[int], options: list[dict], state_before: dict) -> list[str]:
    """What a unit's step wrote outside its parameters' state: the options of its param groups (``groups``: their
    indices, ``options``: every group's options as the step began), the optimizer's attributes (``before``: its
    ``__dict__`` then) and its state not kept under a parameter (``state_before``: :func:`outside_params` then)."""
    written = [f"param group {g}'s {key!r}" for g, group in zip(groups, shadow.param_groups)
               for key, value in group.items()
               if key != "params" and (key not in options[g] or not same(value, options[g][key]))]
    written += [f"attribute {key!r}" for key, value in shadow.__dict__.items() if key != "param_groups"
                and (key not in before or not (value is before[key] or same(value, before[key])))]
    state_now = outside_params(shadow.state)
    written += [f"optimizer.state[{key!r}]" for key in state_now.keys() | state_before.keys()
                if key not in state_now or key not in state_before or not same(state_now[key], state_before[key])]
    return written


def same_options(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def same(a: object, b: object) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare: the same object or not
        return a is b


def changed_since(step: Any, clip_not_asked: Optional[tuple[float, float]], key: tuple, options: list[dict],
                  read: list[list[tuple[nn.Parameter, Optional[Tensor], int]]]) -> Optional[str]:
    """What changed since the overlapped step read it, or None: clipping armed for and not asked for
    (``clip_not_asked``), the optimizer's parameters (``key``: :func:`params_key` then), its groups' options
    (``options``: then), and the gradients ``read`` (per unit, ``(param, grad, its version)``)."""
    optimizer = step.optimizer
    if clip_not_asked is not None:
        return f"no clipping was asked for, though the step was armed for max_norm={clip_not_asked[0]} (and clipped)"
    if params_key(optimizer) != key:
        return "the optimizer's param groups changed"
    for before, group in zip(options, optimizer.param_groups):
        now = {k: v for k, v in group.items() if k != "params"}
        if not same_options(before, now):
            return f"a param group's options changed ({sorted(k for k in now if not same(now[k], before.get(k)))})"
    for unit in read:
        for param, grad, version in unit:
            if param.grad is not grad or (grad is not None and grad._version != version):
                return f"the gradient of {step.names.get(id(param), 'a parameter')!r} changed"
    return None
