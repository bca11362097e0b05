"""What runs before an optimizer step (engine/optim/step_watch.py, norms.py), in a gloo world against one process on the
same global batch: the ``nonfinite`` policy with gradient accumulation, a gradient scaler's overflow under it, a plain
``torch.amp.GradScaler`` on sharded gradients, and clipping where a rank dropped a gradient."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests.exactness_scenarios import assert_matches


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 1)  # the root unit's

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batches(world: int, steps: int, micro: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(2 * world, 8, generator=g) for _ in range(micro)] for _ in range(steps)]


def skip_with_accumulation(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    """Per (sharding, accumulation): three steps of two micro-batches with Adam, the loss of micro-batch 0 of step 1
    infinite (``nonfinite="skip"``). Against one process on the global batches that skips step 1 whole. Accumulation:
    ``"reduce"`` (a reduce-scatter per micro-batch, the default), ``"no_sync"``, ``"no_replica_sync"``."""
    report = {}
    for sharding, accumulation in cases:
        torch.manual_seed(0)
        reference = Mlp()
        model = copy.deepcopy(reference)
        runtime = shard_module(model, sharding=sharding, units=["Sequential"], nonfinite="skip")
        opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
        for step, micro_batches in enumerate(_batches(world, 3, 2)):
            for i, x in enumerate(micro_batches):
                scale = float("inf") if (step, i) == (1, 0) else 0.5  # (the mean over two micro-batches)
                window = {"no_sync": runtime.no_sync, "no_replica_sync": runtime.no_replica_sync}.get(accumulation)
                with window() if window is not None and i == 0 else _nothing():
                    (model(x.chunk(world)[rank]).pow(2).mean() * scale).backward()
                (reference(x).pow(2).mean() * scale).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
            runtime.after_optimizer_step()
            if step != 1:
                ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        assert_matches(runtime, reference, f"{sharding} {accumulation}")
        report[(sharding, accumulation)] = runtime.skipped_steps
    return report


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def scaler_backs_off(rank: int, world: int, policy, steps: int = 8) -> dict:
    """fp16 compute, fp32 masters and reduction, ``ShardedGradScaler`` from 65536: the first steps' scaled gradients
    overflow fp16, so the scaler skips them and backs off. One process on the global batch: the fp32 masters, a
    per-rank fp16 copy scaled by a torch.amp.GradScaler, its gradients summed in fp32 and averaged."""
    torch.manual_seed(0)
    reference = Mlp()
    model = copy.deepcopy(reference)
    runtime = shard_module(model, units=["Sequential"], param_dtype=torch.float16, reduce_dtype=torch.float32,
                           nonfinite=policy)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, reference))
    scaler, ref_scaler = ShardedGradScaler("cpu"), torch.amp.GradScaler("cpu")
    for (x,) in _batches(world, steps, 1, seed=2):
        x = x * 30  # large inputs and loss: scaled by 65536 the fp16 gradients are not finite
        scaler.scale(model(x.chunk(world)[rank]).float().pow(2).mean() * 100).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        runtime.after_optimizer_step()
        sums = [torch.zeros_like(p) for p in reference.parameters()]
        for r in range(world):
            low = copy.deepcopy(reference).half()
            ref_scaler.scale(low(x.chunk(world)[r].half()).float().pow(2).mean() * 100).backward()
            for total, p in zip(sums, low.parameters()):
                total.add_(p.grad.float() / world)
        for p, total in zip(reference.parameters(), sums):
            p.grad = total
        ref_scaler.unscale_(ref_opt)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
    assert_matches(runtime, reference, f"nonfinite={policy}")
    return {"scale": scaler.get_scale(), "reference_scale": ref_scaler.get_scale(),
            "skipped_by_policy": runtime.skipped_steps}


def plain_grad_scaler(rank: int, world: int, sharding: str, overflow_on: int) -> dict:
    """A torch.amp.GradScaler and a ShardedGradScaler each stepping sharded gradients, the gradient infinite on rank
    ``overflow_on``'s shard (-1: none) at the second step: per scaler, the scale each step and the final weights."""
    out = {}
    for make in (lambda: torch.amp.GradScaler("cpu", init_scale=2.0**4),
                 lambda: ShardedGradScaler("cpu", init_scale=2.0**4)):
        torch.manual_seed(0)
        model = Mlp()
        runtime = shard_module(model, sharding=sharding, units=["Sequential"], param_dtype=torch.float16,
                               reduce_dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = make()
        scales = []
        for step, (x,) in enumerate(_batches(world, 3, 1)):
            scaler.scale(model(x.chunk(world)[rank]).float().pow(2).mean()).backward()
            if rank == overflow_on and step == 1:
                next(p for p in model.parameters() if p.grad is not None and p.numel()).grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad()
            runtime.after_optimizer_step()
        out[type(scaler).__name__] = {"scales": scales, "state": full_state_dict(runtime, rank0_only=False)}
    return out


def clipping_with_a_dropped_gradient(rank: int, world: int, sharding: str) -> dict:
    """After backward, the last rank sets ``p.grad = None`` on a parameter whose piece it holds: clipping and the
    gradient norms still all-reduce the same number of values on every rank (mismatched collectives before), with
    that piece counted as zeros; every rank gets the same norm, that of the pieces left."""
    torch.manual_seed(0)
    model = Mlp()
    runtime = shard_module(model, sharding=sharding, units=["Sequential"])
    (x,) = _batches(world, 1, 1)[0]
    model(x.chunk(world)[rank]).pow(2).mean().backward()
    dropped = "blocks.0.0.weight"
    shard = dict(model.named_parameters())[dropped]
    if rank == world - 1:
        assert shard.numel() > 0  # (the last rank holds a piece of it)
        shard.grad = None
    left = torch.stack([p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]).sum()
    torch.distributed.all_reduce(left)  # every rank's pieces are its own (full and grad_op shard every unit)
    names, _, total = runtime.grad_norms(2.0)
    norm = runtime.clip_grad_norm_(list(model.parameters()), 1e-3)
    return {"names": names, "total": float(total), "clipped_total": float(norm), "expected": float(left.sqrt())}


def skip_in_a_closure(rank: int, world: int) -> dict:
    """A raw ``optimizer.step(closure)`` (not the engine's step): torch calls the closure after the step's hooks, so
    the policy runs once the closure returns. Step 0's loss is infinite on the last rank only."""
    torch.manual_seed(0)
    reference = Mlp()
    model = copy.deepcopy(reference)
    runtime = shard_module(model, units=["Sequential"], nonfinite="skip")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for step, (x,) in enumerate(_batches(world, 3, 1)):
        def closure():
            opt.zero_grad()
            loss = model(x.chunk(world)[rank]).pow(2).mean()
            (loss * float("inf") if step == 0 and rank == world - 1 else loss).backward()
            return loss

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step(closure)
        runtime.after_optimizer_step()
        if step:
            reference(x).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert_matches(runtime, reference, "closure")
    return {"skipped": runtime.skipped_steps}
