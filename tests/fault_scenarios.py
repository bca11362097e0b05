"""Fault scenarios run inside a gloo world: a rank dies or stalls; the others must fail fast and clearly."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.comm.collectives import CollectiveError
from lightning_shard.engine.shard_module import shard_module
from tests import models


def _die_or_stall(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no cleanup, sockets close
    time.sleep(25)  # "stall": alive but not calling the next collective, well past the others' timeout
    os._exit(3)


def lost_rank(rank: int, world: int, where: str, how: str):
    """The last rank dies (or stalls) at ``where``; the others report what they were waiting on, and when."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    runtime = shard_module(model, prefetch=0)
    victim = rank == world - 1
    g = torch.Generator().manual_seed(0)
    models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), 0).backward()  # one healthy step
    if victim and where == "forward":
        model.blocks[1].register_forward_pre_hook(lambda m, a: _die_or_stall(how))
    if victim and where == "backward":
        runtime.units[1].storage.gathered_params[0].register_post_accumulate_grad_hook(lambda p: _die_or_stall(how))
    start = time.perf_counter()
    try:
        if where == "save":
            if victim:
                _die_or_stall(how)
            full_state_dict(runtime)
        else:
            models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), 1).backward()
    except CollectiveError as err:
        return {"error": str(err), "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def disagreeing_models(rank: int, world: int):
    model = nn.Sequential(nn.Linear(4, 6 if rank == 0 else 5), nn.Linear(6 if rank == 0 else 5, 2))
    try:
        shard_module(model)
    except ValueError as err:
        return str(err)
    return None


def nonfinite(rank: int, world: int, policy: str):
    """Rank 0's gradient turns NaN at step 1: every rank skips that step (or stops), never diverges."""
    torch.manual_seed(0)
    model = models.Odd()
    runtime = shard_module(model, unit_size=9, nonfinite=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    snapshots, g = [], torch.Generator().manual_seed(0)
    try:
        for step in range(3):
            batch = models.Odd.batch(g, 4)
            if step == 1 and rank == 0:
                batch[0, 0] = float("nan")
            models.Odd.loss(model, batch, step).backward()
            opt.step()
            opt.zero_grad()
            runtime.after_optimizer_step()
            snapshots.append(full_state_dict(runtime, rank0_only=False))
    except FloatingPointError as err:
        return {"error": str(err)}
    unchanged = all(torch.equal(snapshots[0][k], snapshots[1][k]) for k in snapshots[0])
    moved = any(not torch.equal(snapshots[1][k], snapshots[2][k]) for k in snapshots[0])
    finite = all(torch.isfinite(v).all() for v in snapshots[2].values())
    return {"error": None, "skipped": runtime.skipped_steps, "unchanged": unchanged, "moved_after": moved,
            "finite": finite}
