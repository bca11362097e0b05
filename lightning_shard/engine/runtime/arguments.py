"""A unit's call arguments, as the hooks handle them: flattened without pytree where they are plain, cast to the
unit's compute dtype once each; and what a step's output says about the backward to come."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from lightning_shard.engine.runtime.trees import flatten, leaves
from lightning_shard.engine.storage.unit import Unit


def needs_cast(unit: Unit) -> bool:
    """Floating-point inputs go in the unit's ``param_dtype`` when it computes in one lower than its masters and
    autocast is off (FSDP2's ``cast_forward_inputs``): ``F.linear(fp32 input, bf16 weight)`` would raise."""
    storage = unit.storage
    return storage.computes_lower and not torch.is_autocast_enabled(storage.device_type)


def explain_mixed_dtype_on_cpu(err: RuntimeError, units: list[Unit]) -> None:
    """Inputs and buffers stay as they come under autocast (as without sharding), and CPU autocast leaves more ops in
    their inputs' dtype than CUDA's (norms, matrix-vector products): a float32 tensor meeting a unit's bf16 weights
    there raises torch's "mixed dtype (CPU)" or "... must have the same dtype". Say why, and what to do, instead of
    torch's words alone."""
    lower = sorted({str(u.storage.param_dtype) for u in units
                    if u.storage.param_dtype != u.storage.master_dtype and u.storage.device_type == "cpu"})
    message = str(err)
    if lower and ("mixed dtype (CPU)" in message or "must have the same dtype" in message):
        # (the step's autocast has exited by the time it is caught)
        raise RuntimeError(
            f"lightning_shard: under CPU autocast a unit computing in {', '.join(lower)} met a float32 tensor in an op"
            " that CPU autocast leaves in its inputs' dtype (a LayerNorm, GroupNorm or BatchNorm first in the unit fed"
            " a float32 input; a parametrization's matrix-vector product with float32 buffers, as spectral_norm's):"
            " its weights and that tensor differ. Cast that input to the compute dtype in your forward, or gather in"
            " float32 on the CPU (ShardStrategy(mixed_precision=MixedPrecision()) with bf16-mixed).") from err


def cast_floating(flat: list, dtype: torch.dtype) -> list:
    """Each tensor cast once, so a module testing identity (``query is key``) sees the same tensor twice."""
    cast = {id(x): x.to(dtype) for x in flat if isinstance(x, Tensor) and x.is_floating_point()}
    return [cast.get(id(x), x) for x in flat] if cast else flat


_LEAVES = (Tensor, int, float, bool, str, type(None))


def flatten_arguments(args: tuple, kwargs: dict) -> tuple[list, Callable[[list], tuple[tuple, dict]]]:
    """A call's arguments as one flat list, and how to rebuild ``(args, kwargs)`` from it. Plain arguments (tensors,
    numbers, strings, None: a block's usual call) skip pytree, which costs more than the rest of a hook."""
    if not kwargs and len(args) == 1 and isinstance(args[0], _LEAVES):  # a block's usual call
        return list(args), _one_argument
    if all(isinstance(x, _LEAVES) for x in args) and all(isinstance(x, _LEAVES) for x in kwargs.values()):
        count, keys = len(args), tuple(kwargs)
        return [*args, *kwargs.values()], lambda flat: (tuple(flat[:count]), dict(zip(keys, flat[count:])))
    return flatten((args, kwargs))


def _one_argument(flat: list) -> tuple[tuple, dict]:
    return tuple(flat), {}


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def expects_backward(output: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, Tensor) and x.requires_grad for x in leaves(output)
    )
