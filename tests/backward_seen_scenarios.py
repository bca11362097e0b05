"""Scenarios for how the runtime sees a backward begin (run inside a gloo world, see world.py): a unit's output hook
says it for most units; the gradients of the root unit's parameters, and of a unit whose outputs autograd cannot
see, say it for the others; a gradient that no hook saw is refused before an optimizer step uses the others."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import lightning as L
import torch
from torch import Tensor, nn

from lightning_shard.engine.shard_module import shard_module
from tests.exactness_scenarios import assert_matches


def against_ddp(rank: int, world: int, build: Callable[[], nn.Module], shard: Callable[[nn.Module], Any],
                train: Callable[[nn.Module, Tensor], None], tag: str, steps: int = 2, in_step: bool = False) -> bool:
    """``train`` (forwards and backwards of one batch) on the sharded model against DDP's numbers: the same on one
    process over every rank's batch, the gradients averaged; SGD steps; ``in_step``: inside ``runtime.run_step``."""
    torch.manual_seed(0)
    reference = build()
    sharded = copy.deepcopy(reference)
    runtime = shard(sharded)
    ref_opt, opt = torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(sharded.parameters(), lr=0.1)
    runtime.attach_optimizer(opt)
    for step in range(steps):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
        for chunk in x.chunk(world):
            train(reference, chunk)
        for p in reference.parameters():
            if p.grad is not None:  # (a penalty alone gives the last bias none)
                p.grad /= world
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        mine = x.chunk(world)[rank]
        if in_step:
            runtime.run_step(train, sharded, mine)
        else:
            train(sharded, mine)
        runtime.step(opt)
        opt.zero_grad(set_to_none=True)
    assert_matches(runtime, reference, tag)
    return True


def _squared(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).pow(2).mean()


def _squared_backward(model: nn.Module, x: Tensor) -> None:
    _squared(model, x).backward()


def _root_only(model: nn.Module, mode: str) -> Any:
    with warnings.catch_warnings():  # (that the root holds every parameter)
        warnings.simplefilter("ignore")
        runtime = shard_module(model, sharding=mode, units=[])
    assert runtime.units == [runtime.root_unit]
    return runtime


def _no_root(model: nn.Module, mode: str, unit: str, checkpointed: bool = False) -> Any:
    runtime = shard_module(model, sharding=mode, units=[unit], activation_checkpointing=checkpointed)
    assert runtime.root_unit is None  # nothing but the unit's own hooks can see its backward
    return runtime


def root_only_manual_backward(rank: int, world: int, mode: str) -> bool:
    """Every parameter in the root unit and the backward inside the step (Lightning's manual optimization): the step
    returns nothing for the runtime to hook, so only the root's parameters see the backward begin."""
    return against_ddp(rank, world, lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)),
                       lambda model: _root_only(model, mode), _squared_backward, f"root only, {mode}", steps=3,
                       in_step=True)


@dataclass
class Box:
    """An output autograd cannot see into: not a tensor, nor a container pytree knows."""

    h: Tensor


class BoxedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Box:
        return Box(torch.tanh(self.lin(x)))


class Unboxing(nn.Module):
    """No parameter outside the unit: nothing but the unit's own parameters can see its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = BoxedBlock()

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x).h


def boxed_output(rank: int, world: int, mode: str) -> bool:
    return against_ddp(rank, world, Unboxing, lambda model: _no_root(model, mode, "BoxedBlock"), _squared_backward,
                       f"boxed output, {mode}", steps=3)


class KeepsAux(nn.Module):
    """A unit that keeps an auxiliary loss on itself instead of returning it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.aux_head = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        self.aux = self.aux_head(x.detach()).pow(2).mean()  # a graph of its own
        return self.lin(x)


class AuxFromOutput(nn.Module):
    """A unit that keeps a loss computed from its own output, for its caller to add."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.aux_head = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        out = self.lin(x)
        self.aux = self.aux_head(out).pow(2).mean()
        return out


class KeepsAuxOfOutput(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(AuxFromOutput(), AuxFromOutput())

    def training_step(self, batch, batch_idx):
        return self.blocks(batch[0]).square().mean() + sum(block.aux for block in self.blocks)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def unseen_gradients_refused(rank: int, world: int, case: str) -> str:
    """A gradient on a gathered parameter that no reduction took: refused at the optimizer step, on every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), KeepsAux())
    runtime = shard_module(model, sharding="none", units=["KeepsAux"])  # (sharded, its backward reads freed storage)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    runtime.attach_optimizer(opt)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    if case == "aux alone":  # its own backward reaches the unit's parameters only, through no hooked tensor
        model(x).sum().backward()
        model[1].aux.backward()
    else:  # the last backward before the step inside no_sync()
        with runtime.no_sync():
            model(x).sum().backward()
    try:
        runtime.step(opt)
    except RuntimeError as err:
        return str(err)
    return "stepped"


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.nn.functional.leaky_relu(self.a(x), 0.2))


class Shared(nn.Module):
    """One unit called twice, the first call's input needing no gradient (weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Critic()

    def forward(self, x: Tensor) -> Tensor:
        return self.block(torch.tanh(self.block(x)))


def _penalty(model: nn.Module, x: Tensor) -> Tensor:
    x = x.clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    return slope.pow(2).sum(dim=1).mean()


def _penalty_alone(model: nn.Module, x: Tensor) -> None:  # StyleGAN2's lazy R1: a step of the penalty only
    _penalty(model, x).backward()


def _penalty_after_the_loss(model: nn.Module, x: Tensor) -> None:  # two manual_backward calls, as in a GAN
    penalty = _penalty(model, x)
    model(x).pow(2).mean().backward()
    penalty.backward()


def _two_losses_retained(model: nn.Module, x: Tensor) -> None:
    out = model(x)
    out.pow(2).mean().backward(retain_graph=True)
    out.mean().backward()


def separate_backwards(rank: int, world: int, mode: str, case: str, steps: int = 2, checkpointed: bool = False) -> bool:
    """Backwards that reach a unit's parameters other than through its outputs, against DDP's averaged gradients:
    the only unit of a critic (nothing trainable in the root) reached through a penalty's graph, alone or after the
    loss's own backward; a unit called twice and two backwards through one graph."""
    build, train = {
        "penalty alone": (lambda: nn.Sequential(Critic()), _penalty_alone),
        "penalty after the loss": (lambda: nn.Sequential(Critic()), _penalty_after_the_loss),
        "twice, two backwards": (Shared, _two_losses_retained),
    }[case]
    return against_ddp(rank, world, build, lambda model: _no_root(model, mode, "Critic", checkpointed), train,
                       f"{case}, {mode}", steps)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Critic() for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def micro_batches_in_one_step(rank: int, world: int) -> list[int]:
    """Three forward-backward micro-batches inside one step (a loop in ``training_step``): each backward frees and
    reduces each unit as its own backward ends, so the peak of gathered bytes is the same in each."""
    torch.manual_seed(0)
    model = Chain()
    runtime = shard_module(model, sharding="full", units=["Critic"])
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    peaks = []

    def step() -> None:
        for chunk in x.chunk(3):
            runtime.schedule.peak_gathered_bytes = runtime.schedule.gathered_bytes
            model(chunk).pow(2).mean().backward()
            peaks.append(runtime.schedule.peak_gathered_bytes)

    runtime.run_step(step)
    return peaks
