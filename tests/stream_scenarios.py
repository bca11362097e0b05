"""Scenarios for test_streams.py, run inside a gloo world: the engine's stream hand-overs, checked on the CPU."""

from __future__ import annotations

import torch

from lightning_shard.engine.comm.streams import HostStreams, StreamRace
from lightning_shard.engine.shard_module import shard_module
from tests import models

HANDOVERS = [("compute", "gather"), ("gather", "compute"), ("compute", "reduce"), ("reduce", "compute")]


def _train(runtime, model, steps: int = 2) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 37, (4, 9))
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        runtime.after_optimizer_step()


def each_handover_removed(rank: int, world: int) -> dict:
    """Train with a checking HostStreams, whole and then with one hand-over left out at a time: the clean run
    must pass, and each removal must be reported (both ranks see the same order, so both raise at the same
    point and the next case starts with the ranks' collectives aligned)."""
    found: dict = {}
    for missing in [None, *HANDOVERS]:
        torch.manual_seed(0)
        model = models.TinyGPT()
        runtime = shard_module(model, prefetch=1, param_dtype=torch.bfloat16)  # a real copy-in cast, too
        streams = runtime.schedule.streams = runtime.reducer.streams = runtime.streams = HostStreams(check=True)
        if missing is not None:
            handover = streams.handover
            streams.handover = lambda p, c, h=handover, m=missing: None if (p, c) == m else h(p, c)
        try:
            _train(runtime, model)
            found[missing] = None
        except StreamRace as race:
            found[missing] = str(race)
        runtime.remove_hooks()
    return found
