"""The fused optimizer step taken where the user chose no implementation (``engine/optim/fused_default.py``), run on the
CPU by letting the CPU count as a GPU for that choice: against DDP with torch's default (the for-loop) and with
the implementation the user named."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.optim import fused_default
from lightning_shard.engine.shard_module import shard_module
from tests import models
from tests.optimizer_scenarios import decay_groups, train


def _count_fused_calls() -> dict[str, int]:
    """Counts the fused kernels' Python entries (torch's functional ``adam`` and ``sgd`` look them up per call)."""
    import importlib

    calls = {"adam": 0, "sgd": 0}
    for name, attr in (("adam", "_fused_adam"), ("sgd", "_fused_sgd")):
        module = importlib.import_module(f"torch.optim.{name}")
        original = getattr(module, attr)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, attr, counted)
    return calls


OPTIMIZERS = {
    "adamw": lambda named: torch.optim.AdamW(decay_groups(named, 0.1), lr=1e-2),
    "adam_amsgrad": lambda named: torch.optim.Adam(decay_groups(named, 0.0), lr=1e-2, amsgrad=True),
    "sgd_nesterov": lambda named: torch.optim.SGD(decay_groups(named, 1e-3), lr=0.05, momentum=0.9, nesterov=True),
    "adamw_foreach": lambda named: torch.optim.AdamW(decay_groups(named, 0.1), lr=1e-2, foreach=True),
}


def against_ddp(rank: int, world: int, steps: int = 12) -> dict:
    fused_default.GPU_DEVICES = ("cpu",)  # this rank's process only: the CPU stands in for a GPU here
    calls = _count_fused_calls()
    g = torch.Generator().manual_seed(1234)
    batches = [models.TinyGPT.batch(g, 12) for _ in range(steps)]
    report = {}
    for name, build in OPTIMIZERS.items():
        torch.manual_seed(0)
        reference = models.TinyGPT(d=16, n_blocks=3)
        sharded = copy.deepcopy(reference)
        ref_opt = build(list(reference.named_parameters()))
        expected = train(DDP(reference), [ref_opt], batches, rank, world, clip=0.5)
        before = dict(calls)
        runtime = shard_module(sharded)
        with runtime.shaped_parameters():
            opt = build(list(sharded.named_parameters()))
        runtime.attach_optimizer(opt)
        losses = train(sharded, [opt], batches, rank, world, clip=0.5, runtime=runtime)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"[{name}] losses differ from DDP: {m}")
        full = full_state_dict(runtime, rank0_only=False)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"[{name}] {k}: {m}")
        report[name] = {"fused_calls": {k: calls[k] - before[k] for k in calls},
                        "groups_fused": [group["fused"] for group in opt.param_groups],
                        "groups_foreach": [group["foreach"] for group in opt.param_groups]}
    return report


def counters_after_a_load(rank: int, world: int) -> dict:
    """A state whose ``step`` counters came another way (here: float64, as a checkpoint may hold them) is stepped
    fused once they are placed where the fused kernel reads them."""
    fused_default.GPU_DEVICES = ("cpu",)
    torch.manual_seed(0)
    model = models.TinyGPT(d=16, n_blocks=2)
    runtime = shard_module(model)
    with runtime.shaped_parameters():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runtime.attach_optimizer(opt)
    g = torch.Generator().manual_seed(5)
    train(model, [opt], [models.TinyGPT.batch(g, 8) for _ in range(2)], rank, world, runtime=runtime)
    saved = opt.state_dict()
    for state in saved["state"].values():
        state["step"] = state["step"].to(torch.float64)
    opt.load_state_dict(saved)
    loaded = sorted({str(s["step"].dtype) for s in opt.state.values()})
    losses = train(model, [opt], [models.TinyGPT.batch(g, 8) for _ in range(2)], rank, world, runtime=runtime)
    dist.barrier()
    return {"loaded": loaded, "stepped": sorted({str(s["step"].dtype) for s in opt.state.values()}),
            "steps": sorted({s["step"].item() for s in opt.state.values()}), "losses": losses}


def sgd_momentum_unfrozen_later(rank: int, world: int, steps: int = 5) -> dict:
    """SGD with momentum over one group whose first layer is frozen for two steps, then unfrozen (gradual
    unfreezing): torch's fused SGD fails on a mix of parameters with and without momentum buffers, so that step
    runs unfused. Against one process on the global batches."""
    from torch import nn

    fused_default.GPU_DEVICES = ("cpu",)
    calls = _count_fused_calls()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    sharded = copy.deepcopy(reference)
    runtime = shard_module(sharded, units=["Linear"])
    with runtime.shaped_parameters():
        opt = torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9)
    runtime.attach_optimizer(opt)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(steps)]
    size = 4 // world
    fused_per_step = []
    for model, optimizer, rows in ((reference, ref_opt, slice(None)), (sharded, opt, slice(rank * size, (rank + 1) * size))):
        model[0].requires_grad_(False)
        for step, (x, y) in enumerate(data):
            if step == 2:
                model[0].requires_grad_(True)
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            before = calls["sgd"]
            optimizer.step() if model is reference else runtime.step(optimizer)
            if model is sharded:
                fused_per_step.append(calls["sgd"] - before)
            optimizer.zero_grad(set_to_none=True)
    full = full_state_dict(runtime, rank0_only=False)
    return {"max_diff": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
            "fused_per_step": fused_per_step}
