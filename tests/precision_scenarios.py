"""Precision scenarios run inside a gloo world (see world.py)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_shard.engine.shard_module import shard_module
from lightning_shard.lightning.precision import ShardedGradScaler
from tests import models


def bf16_mixed_dtypes(rank: int, world: int):
    """One step of bf16-mixed: what each tensor's dtype is, and the bytes moved, next to fp32."""
    report = {}
    for name, param_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        model = models.TinyGPT()
        runtime = shard_module(model, param_dtype=param_dtype, reduce_dtype=torch.float32)
        seen = {}
        block = model.blocks[1]

        def note(key, value):  # hooks must return None
            seen.setdefault(key, value)

        block.register_forward_pre_hook(lambda m, a: note("gathered", m.ln1.weight.dtype))
        block.ln1.register_full_backward_hook(lambda m, gi, go: note("in_backward", m.weight.dtype))
        runtime.units[1].storage.gathered_params[0].register_post_accumulate_grad_hook(
            lambda p: note("unsharded_grad", p.grad.dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype is not None):
                loss = models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), step)
            loss.backward()
            seen["shard_grad"] = next(p.grad.dtype for p in model.parameters() if p.grad is not None)
            opt.step()
            runtime.after_optimizer_step()
        seen["master"] = {p.dtype for p in model.parameters()}
        seen["optimizer_state"] = {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
        seen["stats"] = runtime.last_step_stats
        seen["padded"] = {u.name: u.storage.padded_numel for u in runtime.units}
        seen["last"] = runtime.order[-1].name
        seen["loss"] = loss.item()
        report[name] = seen
    return report


def scaler_overflow_on_one_rank(rank: int, world: int):
    """fp16 training step where only the last rank's gradient shard overflows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    shard_module(model, param_dtype=torch.float16, reduce_dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    if rank == world - 1:
        next(p for p in model.parameters() if p.grad is not None and p.numel()).grad[0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"unchanged": unchanged, "scale": scaler.get_scale()}
