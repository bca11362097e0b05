"""Writes into the shard gradients between micro-batches under ``no_sync()`` that keep their values (a
``clip_grad_norm_`` below its norm or ``nan_to_num_`` in ``on_after_backward``, which runs after every micro-batch)
are no ``zero_grad``: the unreduced micro-batches stay (they were dropped, as after a zero_grad: 2 of 3 lost)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests.fsdp2_port_common import MLP, compare, run_all

HOOKS = {  # what an on_after_backward does with the gradients, keeping their values
    "clip": lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6),
    "nan_to_num": lambda model: [p.grad.nan_to_num_() for p in model.parameters() if p.grad is not None],
    # new tensors of the same values (round five, 3: taken for a zero_grad, the micro-batches were dropped: 0.12 off)
    "replaced_nan_to_num": lambda model: [setattr(p, "grad", torch.nan_to_num(p.grad)) for p in model.parameters()
                                          if p.grad is not None],
    "replaced_clone": lambda model: [setattr(p, "grad", p.grad.clone()) for p in model.parameters()
                                     if p.grad is not None],
}


def written_between_micro_batches(rank: int, world: int, hook: str, mode: str, offload=None) -> None:
    """Three micro-batches, the first two under no_sync, ``hook`` after each backward; against one process on the
    same global batch (fsdp2_port_common.compare: zero_grad to None and to zeros on alternate steps)."""
    def step(model, x, i, side):
        total = 0.0
        for m, mb in enumerate(x.chunk(3)):
            with side.no_sync() if m < 2 else torch.enable_grad():
                loss = model(mb).sum()
                loss.backward()
            HOOKS[hook](model)
            total = total + loss.detach()
        return total

    extra = {} if offload is None else {"offload": offload}
    compare(rank, world, lambda: nn.Sequential(nn.Linear(8, 8), *(MLP() for _ in range(3))), step,
            f"{hook}/{mode}/{offload}", rows=6, mode=mode, units=["MLP"], **extra)


class Adapted(nn.Module):
    """A bf16 base with an fp32 adapter in one unit (peft's LoRA recipe): the micro-batches are summed in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.adapter = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.base(x.to(torch.bfloat16)).float() + self.adapter(x)


def mixed_dtype_clip(rank: int, world: int) -> None:
    """The same sharded model with and without a value-keeping clip after each micro-batch: bit for bit."""
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(6, 8, generator=g) for _ in range(2)]
    torch.manual_seed(0)
    build = lambda: nn.Sequential(Adapted(), Adapted())  # noqa: E731
    models = [build(), build()]
    models[1].load_state_dict(models[0].state_dict())
    runtimes = [shard_module(m, units=["Adapted"], param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for m in models]
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    for batch in batches:
        for model, runtime, opt in zip(models, runtimes, opts):
            for m, mb in enumerate(batch.chunk(3)):
                with runtime.no_sync() if m < 2 else torch.enable_grad():
                    model(mb).pow(2).mean().backward()
                if model is models[0]:
                    HOOKS["clip"](model)
            opt.step()
            opt.zero_grad(set_to_none=False)
    states = [full_state_dict(runtime, rank0_only=False) for runtime in runtimes]
    differ = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
    assert not differ, f"[mixed_dtype_clip] a clip after each micro-batch changed {differ}"


class Pair(nn.Module):
    """A GAN's two networks in one unit of two dtypes: an fp32 generator layer and a bf16 discriminator layer."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Linear(8, 8)
        self.d = nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x):
        return self.d(self.g(x).to(torch.bfloat16)).float()


def one_optimizer_zeroed_in_a_mixed_unit(rank: int, world: int) -> None:
    """bf16 compute, 3 micro-batches (two inside no_sync): after the first, one optimizer's zero_grad clears the
    discriminator's half of the unit (refused before: its dtypes' micro-batches are held together); bit for bit the same
    sharded model whose discriminator was frozen for the first micro-batch's backward instead."""
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(6, 8, generator=g) for _ in range(2)]
    torch.manual_seed(0)
    models = [nn.Sequential(Pair(), Pair()), nn.Sequential(Pair(), Pair())]
    models[1].load_state_dict(models[0].state_dict())
    runtimes = [shard_module(m, units=["Pair"], param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for m in models]
    discriminators = [[p for n, p in m.named_parameters() if ".d." in n] for m in models]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    d_optimizers = [torch.optim.SGD(d, lr=0.0) for d in discriminators]  # (only zeroes)
    for batch in batches:
        for i, (model, runtime) in enumerate(zip(models, runtimes)):
            for m, mb in enumerate(batch.chunk(3)):
                frozen = i == 1 and m == 0
                for p in discriminators[i] if frozen else ():
                    p.requires_grad_(False)
                with runtime.no_sync() if m < 2 else torch.enable_grad():
                    model(mb).pow(2).mean().backward()
                for p in discriminators[i] if frozen else ():
                    p.requires_grad_(True)
                if i == 0 and m == 0:
                    d_optimizers[0].zero_grad()
            optimizers[i].step()
            optimizers[i].zero_grad()
    states = [full_state_dict(runtime, rank0_only=False) for runtime in runtimes]
    differ = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
    assert not differ, f"[one_optimizer_zeroed_in_a_mixed_unit] {differ} differ"


def cases() -> dict:
    out = {f"{hook}/{mode}/{offload}": (lambda r, w, h=hook, m=mode, o=offload: written_between_micro_batches(r, w, h, m, o))
           for hook, mode, offload in [("clip", "full", None), ("nan_to_num", "grad_op", None),
                                       ("clip", "full", "optimizer"), ("nan_to_num", "full", "params"),
                                       ("replaced_nan_to_num", "full", None), ("replaced_clone", "grad_op", None),
                                       ("replaced_nan_to_num", "none", None), ("replaced_clone", "full", "optimizer"),
                                       ("replaced_nan_to_num", "full", "params")]}
    out["mixed_dtype_clip"] = mixed_dtype_clip
    out["one_optimizer_zeroed_in_a_mixed_unit"] = one_optimizer_zeroed_in_a_mixed_unit
    return out


def run(rank: int, world: int, names: list[str]) -> dict:
    return run_all(rank, world, cases(), names)
