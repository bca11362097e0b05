"""Estimated against measured peak memory: a real sharded step in a gloo world, every tensor counted."""

from __future__ import annotations

import torch

from lightning_shard.engine.shard_module import shard_module
from lightning_shard.memory.estimate import estimate_memory
from lightning_shard.memory.tracker import LiveBytes
from tests import models


def loss(model, batch):
    return models.TinyGPT.loss(model, batch, 0)


def estimated_and_measured(rank: int, world: int, sharding: str, options: dict, batch_size: int,
                           d: int = 64, seq: int = 32, steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = models.TinyGPT(vocab=37, d=d, n_blocks=4, seq=seq)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 37, (batch_size, seq + 1), generator=g) for _ in range(steps)]
    estimate = estimate_memory(model, world, sharding, step=loss, batch=batches[0], **options)
    runtime = shard_module(model, sharding=sharding, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    live = LiveBytes()
    for i, batch in enumerate(batches):
        if i == steps - 1:  # the optimizer state exists: measure a steady step
            live.__enter__()
            gathered = [u.storage.gathered for u in runtime.units]
            # offload: the staging copies and the shards kept on the device (on a CPU run, all one memory)
            gathered += [t for u in runtime.units for t in (getattr(u.storage, "_staging", None),
                                                            getattr(u.storage, "_on_device", None)) if t is not None]
            state = [v for s in opt.state.values() for v in s.values()]
            live.track([*model.parameters(), *model.buffers(), *gathered, *state, batch])
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        runtime.after_optimizer_step()
    live.__exit__(None, None, None)
    return {"estimate": estimate.as_dict(), "measured": live.peak}
