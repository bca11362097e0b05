"""Where one original parameter lives (its slot in a unit's flat buffer and in the module tree), and the guard on
its shard parameter: only the reducer gives a shard parameter its gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives in the flat buffer and in the module tree."""

    names: tuple[str, ...]  # fully qualified names, several for tied weights
    locations: tuple[tuple[nn.Module, str], ...]  # (module, attribute) pairs that register it
    shape: torch.Size
    offset: int  # in the flat (unsharded) buffer
    numel: int
    requires_grad: bool


def _refuse_autograd_grads(shard: nn.Parameter, slot: ParamSlot) -> None:
    """Only the reducer gives a shard parameter its ``.grad``. Autograd accumulating into one means the shard,
    a 1-D slice of this rank's part, was computed with as if it were the parameter: read while its unit was
    not gathered. Whatever came out (a shape error, or a silently wrong value) must not train on."""
    if getattr(shard, "_refuses_autograd_grads", False):
        return

    name = slot.names[0]  # (not the slot: autograd holds this hook from C++, unseen by the garbage collector, and the
    # slot's modules would stay alive with it)

    def refuse(_: Tensor) -> None:
        raise RuntimeError(
            f"lightning_shard: {name!r} was used while its unit was not gathered: it was reached through"
            " `self.parameters()` or a reference kept from outside the step (a penalty over `self.parameters()` in"
            " training_step), not looked up by name. A unit's parameters are gathered when one of its modules is"
            " called, or when one of them is looked up by name inside a step (`self.wpe.weight`): read it by name"
            " there, or compute it inside a forward (weight decay: the optimizer's `weight_decay`).")

    shard.register_post_accumulate_grad_hook(refuse)
    shard._refuses_autograd_grads = True
