"""Scenarios for "exact or loud" where ranks run different modules (run inside a gloo world, see world.py): routed
experts held as modules of their own, each rank's data routed to another expert."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_shard.engine.shard_module import shard_module


class Routed(nn.Module):
    """A stem, two experts of the same shape (their units' all-gathers are alike) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.head(self.experts[expert](self.stem(x))).sum()


def experts_of_their_own(rank: int, world: int, case: str) -> str:
    """``case``: "train", "frozen" (the experts frozen: no reduction tells), "eval" (no backward), or "same" (every
    rank routed to expert 1: the control, against one process). The error, or what the control computed."""
    torch.manual_seed(0)
    model = Routed()
    if case == "frozen":
        model.experts.requires_grad_(False)
    plain = copy.deepcopy(model)
    shard_module(model, units=["Linear"])  # each expert a unit of its own
    expert = 1 if case == "same" else rank
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    try:
        with torch.set_grad_enabled(case != "eval"):
            loss = model(x, expert)
            if case != "eval":
                loss.backward()
    except RuntimeError as err:
        return str(err)
    return f"computed {torch.equal(loss.detach(), plain(x, expert).detach())}"
