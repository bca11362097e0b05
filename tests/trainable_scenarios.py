"""Scenarios for "exact or loud" where ranks change what they train (run inside a gloo world, see world.py):
parameters frozen and unfrozen between steps as fine-tuning callbacks do, and inside a step as Lightning's
``toggle_optimizer`` does, each trained against one process on the same global batch."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_shard.engine.shard_module import shard_module
from tests.exactness_scenarios import assert_matches


class Finetuned(nn.Module):
    """A backbone of two units and a head, frozen and unfrozen between steps as fine-tuning callbacks do."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2)))
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        return self.head(self.backbone(x))


def freeze_unfreeze(rank: int, world: int, mode: str, steps: int = 6):
    """Backbone frozen at setup and unfrozen at step 2 with a param group of its own (BackboneFinetuning's
    way), the head frozen at step 4, one backbone layer frozen again at step 5: one process on the global
    batch is the reference."""
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randn(3 * world, 6, generator=g), torch.randn(3 * world, 1, generator=g)) for _ in range(steps)]
    torch.manual_seed(0)
    reference = Finetuned()
    reference.backbone.requires_grad_(False)
    sharded = copy.deepcopy(reference)
    runtime = shard_module(sharded, sharding=mode, units=["Sequential"])
    for model, chunk in ((reference, slice(None)), (sharded, slice(3 * rank, 3 * rank + 3))):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(batches):
            if step == 2:
                model.backbone.requires_grad_(True)
                opt.add_param_group({"params": list(model.backbone.parameters()), "lr": 3e-3})
            if step == 4:
                model.head.requires_grad_(False)
            if step == 5:
                model.backbone[0].requires_grad_(False)
            nn.functional.mse_loss(model(x[chunk]), y[chunk]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert_matches(runtime, reference, mode)
    return [name for name, p in sharded.named_parameters() if p.requires_grad]


def freeze_on_one_rank(rank: int, world: int):
    """A rank that freezes a layer the others train: an error naming the cause on every rank."""
    model = Finetuned()
    shard_module(model, sharding="grad_op", units=["Sequential"])
    model(torch.randn(2, 6)).sum().backward()
    if rank == 1:
        model.head.requires_grad_(False)
    model(torch.randn(2, 6)).sum().backward()


class Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _toggle(active: torch.optim.Optimizer, everything: list[torch.optim.Optimizer]) -> dict:
    """Lightning's ``toggle_optimizer``: every optimizer's parameters frozen but the active one's."""
    state = {p: p.requires_grad for opt in everything for group in opt.param_groups for p in group["params"]}
    for p in state:
        p.requires_grad_(False)
    for group in active.param_groups:
        for p in group["params"]:
            p.requires_grad_(state[p])
    return state


def gan_toggling_inside_the_step(rank: int, world: int, mode: str, steps: int = 3):
    """A manual-optimization GAN step (as Lightning's docs write it): ``toggle_optimizer`` freezes the other
    network *inside* the step, so the generator's loss gives the discriminator no gradient. Each rank runs its
    chunk inside ``run_step`` (the strategy's step); the reference runs every chunk in one process and averages."""
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(2 * world, 3, generator=g), torch.randn(2 * world, 4, generator=g)) for _ in range(steps)]
    torch.manual_seed(0)
    reference = Gan()
    sharded = copy.deepcopy(reference)
    runtime = shard_module(sharded, sharding=mode, units=["Sequential"])

    def step(model, z, real, opts, scale):
        opt_g, opt_d = opts
        state = _toggle(opt_g, opts)
        fake = model.generator(z)
        (-model.discriminator(fake).mean() * scale).backward()
        for p, flag in state.items():  # untoggle
            p.requires_grad_(flag)
        state = _toggle(opt_d, opts)
        d_loss = model.discriminator(fake.detach()).mean() - model.discriminator(real).mean()
        (d_loss * scale).backward()
        for p, flag in state.items():
            p.requires_grad_(flag)

    for model in (reference, sharded):
        opts = [torch.optim.SGD(model.generator.parameters(), lr=0.1),
                torch.optim.SGD(model.discriminator.parameters(), lr=0.1)]
        for z, real in batches:
            if model is reference:  # each rank's chunk, averaged as the reduction does
                for r in range(world):
                    step(model, z.chunk(world)[r], real.chunk(world)[r], opts, 1 / world)
            else:
                runtime.run_step(step, model, z.chunk(world)[rank], real.chunk(world)[rank], opts, 1.0)
            for opt in opts:
                opt.step()
                opt.zero_grad()
    assert_matches(runtime, reference, mode)
    return True
