"""A unit's parameters returned from its forward: Megatron's layers return ``(output, self.bias)`` for the caller to
fuse (DeepSpeed's ``LinearWrapper``), DeepSpeed's test_ext_param_returnobj an object holding ``self.bias``. The returned
tensor is a view of the unit's gathered buffer, which the unit frees after its forward (``full``) or after its
backward: the caller would read freed memory (a segfault). :func:`keep_returned` hands the caller a copy instead, made
as the forward ends and differentiable, so the gradient reaches the gathered parameter as it would have."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_shard.engine.runtime.trees import is_plain_object


def keep_returned(output: Any, gathered: frozenset[int]) -> tuple[Any, bool]:
    """``output`` with each tensor that is one of the unit's gathered parameters (``gathered``: their ids), or a view of
    one, replaced by a copy; and whether a copy may carry a gradient back to them. Inside a plain object the copy
    replaces the attribute in place (the object is the unit's fresh return value)."""
    if isinstance(output, Tensor):
        return _copy(output) if _is_parameter(output, gathered) else (output, False)
    if type(output) is tuple:  # a block's usual tuple of tensors: no pytree
        for x in output:
            if isinstance(x, Tensor):
                if _is_parameter(x, gathered):
                    break
            elif x is not None:
                break
        else:
            return output, False
    return _kept(output, gathered, set())


def _kept(output: Any, gathered: frozenset[int], seen: set[int]) -> tuple[Any, bool]:
    flat, spec = tree_flatten(output)
    carries, changed = False, False
    for i, x in enumerate(flat):
        if isinstance(x, Tensor) and _is_parameter(x, gathered):
            flat[i], grad = _copy(x)
            carries, changed = carries or grad, True
        elif is_plain_object(x) and id(x) not in seen:
            seen.add(id(x))
            for name, value in list(vars(x).items()):
                kept, grad = _kept(value, gathered, seen)
                if kept is not value:
                    setattr(x, name, kept)
                    carries = carries or grad
    return (tree_unflatten(flat, spec) if changed else output), carries


def _is_parameter(x: Tensor, gathered: frozenset[int]) -> bool:
    return id(x) in gathered or (x._is_view() and id(x._base) in gathered)


def _copy(x: Tensor) -> tuple[Tensor, bool]:
    return x.clone(), torch.is_grad_enabled() and x.requires_grad
