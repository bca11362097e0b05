"""Scenarios for test_compile.py, run inside a gloo world: compiled units against the same units run eagerly."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests import models

STEPS = 6
NAMES = ("eager", "compile_option", "compiled_by_user")


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def compiled_and_eager(rank: int, world: int) -> dict:
    """The same training three ways: eager, ``compile=True`` (the engine compiles each unit's blocks), and the
    user's own ``block.compile()`` in place (its hooks are then reached from a compiled frame). The collectives
    are compared too: the same ones, in the same order (prefetch included)."""
    g = torch.Generator().manual_seed(7)
    batches = [models.TinyGPT.batch(g, 8) for _ in range(STEPS)]
    report = {}
    for name in NAMES:
        torch._dynamo.reset()  # each compiled run traces its own graphs, counted from zero
        counters.clear()
        torch.manual_seed(0)
        model = models.TinyGPT()
        if name == "compiled_by_user":
            for block in model.blocks:
                block.compile()
        runtime = shard_module(model, units=["Block"], prefetch=1,
                               compile=name == "compile_option")
        runtime.trace = []
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        runtime.attach_optimizer(opt)
        losses, graphs = [], []
        for step, batch in enumerate(batches):
            loss = models.TinyGPT.loss(model, batch.chunk(world)[rank], step)
            loss.backward()
            runtime.clip_grad_norm_(list(model.parameters()), 1.0)
            runtime.step(opt)
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append((total / world).item())
            graphs.append(_graphs())
        with torch.no_grad():  # an evaluation forward: a second graph per block (grad mode), then none
            logits = [model(batches[0][:, :-1]) for _ in range(2)]
        report[name] = {
            "losses": losses, "graphs": graphs, "graphs_after_eval": _graphs(), "trace": runtime.trace,
            "state": full_state_dict(runtime), "logits": logits[-1],
        }
    return report
