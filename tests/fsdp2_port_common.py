"""The harness of the FSDP2 port (fsdp2_port_*_scenarios.py): a sharded model and one process on the same global
batch run the same step function, the reference over every rank's chunk in turn with its new gradients averaged,
as DDP means them. As FSDP2's tests do, every scenario zeroes gradients with ``set_to_none`` alternating (zero
tensors on odd steps) and steps AdamW with weight decay (a zero gradient and no gradient step differently)."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module

# fp32 throughout: the ranks' gradients are summed in another order than the reference's, ~1e-7 relative per step
RTOL, ATOL = 1e-5, 1e-6


class Side:
    """What a step function may ask of its side: ``no_sync()`` (the reference accumulates locally anyway)."""

    def __init__(self, runtime=None, rank: int = 0, world: int = 1) -> None:
        self.runtime, self.rank, self.world = runtime, rank, world

    def no_sync(self):
        return nullcontext() if self.runtime is None else self.runtime.no_sync()


Step = Callable[[nn.Module, torch.Tensor, int, Side], torch.Tensor]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def compare(rank: int, world: int, build: Callable[[], nn.Module], step: Step, tag: str, steps: int = 4,
            rows: int = 2, dim: int = 8, mode: str = "full", before_step: Optional[Callable] = None,
            check_grads: bool = True, after_grads: Optional[Callable] = None, **shard_kwargs: Any) -> dict:
    """``step(model, x, i, side)`` runs forwards and backwards of step ``i`` on ``x`` and returns the loss; the
    reference runs it on each rank's chunk. ``before_step(model, i)`` may freeze or unfreeze (after zero_grad);
    ``after_grads(model, runtime)`` runs on the averaged gradients (clipping; ``runtime`` is None for the reference).
    Checks each step's mean loss, which parameters have a gradient, and every parameter after the last step."""
    g = torch.Generator().manual_seed(11)
    batches = [torch.randn(rows * world, dim, generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    reference = build()
    sharded = copy.deepcopy(reference)
    runtime = shard_module(sharded, sharding=mode, **shard_kwargs)
    ref_opt, opt = adamw(reference), adamw(sharded)
    for i, batch in enumerate(batches):
        set_to_none = i % 2 == 0
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        if before_step is not None:
            before_step(reference, i)
            before_step(sharded, i)
        ref_loss = sum(step(reference, chunk, i, Side()).detach() for chunk in batch.chunk(world)) / world
        for p in reference.parameters():
            if p.grad is not None:
                p.grad /= world  # (a zeroed gradient is zero before the step: divides only this step's sum)
        loss = step(sharded, batch.chunk(world)[rank], i, Side(runtime, rank, world)).detach().clone()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / world, ref_loss, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"[{tag}] step {i} loss: {m}")
        if after_grads is not None:
            after_grads(reference, None)
            after_grads(sharded, runtime)
        if check_grads:
            has = [n for n, p in sharded.named_parameters() if p.grad is not None]
            expected = [n for n, p in reference.named_parameters() if p.grad is not None]
            assert has == expected, f"[{tag}] step {i}: gradients on {has}, the reference's on {expected}"
            assert_same_grads(sharded, reference, f"{tag}] step {i}")
        ref_opt.step()
        opt.step()
    assert_same(runtime, reference, tag)
    return {"units": [u.name for u in runtime.units]}


def assert_same_grads(sharded: nn.Module, reference: nn.Module, tag: str, rtol: float = RTOL,
                      atol: float = ATOL) -> None:
    """The full gradients (each parameter's shards in rank order) equal the reference's averaged ones: AdamW alone
    would hide a gradient off by a constant factor."""
    mine = {n: p.grad for n, p in sharded.named_parameters() if p.grad is not None}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for name, param in reference.named_parameters():
        if param.grad is not None:
            full = torch.cat([grads[name].reshape(-1) for grads in everyone if name in grads])[: param.numel()]
            torch.testing.assert_close(full, param.grad.reshape(-1), rtol=rtol, atol=atol,
                                       msg=lambda m, n=name: f"[{tag} gradient of {n}: {m}")


def assert_same(runtime, reference: nn.Module, tag: str) -> None:
    full = full_state_dict(runtime, rank0_only=False)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"[{tag}] {n}: {m}")


def run_all(rank: int, world: int, cases: dict[str, Callable], names: list[str]) -> dict[str, str]:
    """Each case in turn in one world; a case that raises is reported by name (the others still run)."""
    import traceback

    out = {}
    for name in names:
        try:
            cases[name](rank, world)
            out[name] = "ok"
        except Exception as err:  # noqa: BLE001 (reported to the test, which fails naming it)
            out[name] = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-3)}"
        dist.barrier()
    return out


class MLP(nn.Module):
    """FSDP2's test MLP (common_fsdp.MLP): in_proj, relu, out_proj."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))
