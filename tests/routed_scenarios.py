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
    """``case``: "train", "frozen" (the experts frozen: no reduction tells), "inputs" (everything frozen, a backward
    to the inputs: nothing reduced), "eval" (no backward), or "same" (every rank routed to expert 1: the control,
    against one process). The error, or what the control computed."""
    torch.manual_seed(0)
    model = Routed()
    if case in ("frozen", "inputs"):
        (model.experts if case == "frozen" else model).requires_grad_(False)
    plain = copy.deepcopy(model)
    shard_module(model, units=["Linear"])  # each expert a unit of its own
    expert = 1 if case == "same" else rank
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank), requires_grad=case == "inputs")
    try:
        with torch.set_grad_enabled(case != "eval"):
            loss = model(x, expert)
            if case != "eval":
                loss.backward()
    except RuntimeError as err:
        return str(err)
    return f"computed {torch.equal(loss.detach(), plain(x, expert).detach())}"


def raising_on_one_rank(rank: int, world: int, grad: bool) -> tuple[str, float]:
    """A step that raises on rank 1 only (a bad batch), with or without a backward to come: that rank's error at
    once, not an agreement the other ranks never join (waited out until the process-group timeout)."""
    import time

    model = Routed()
    runtime = shard_module(model, units=["Linear"])
    start = time.monotonic()

    def step() -> torch.Tensor:
        if rank == 1:
            raise ValueError("a bad batch on rank 1")
        return model(torch.randn(4, 8), 0)

    try:
        with torch.set_grad_enabled(grad):
            runtime.run_step(step)
            runtime.run_step(step)
    except Exception as err:  # noqa: BLE001 - what each rank sees is the test
        return f"{type(err).__name__}: {err}"[:60], time.monotonic() - start
    return "finished", time.monotonic() - start
