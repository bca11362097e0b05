"""FSDP2's own training scenarios (pytorch test/distributed/_composable/fsdp/test_fully_shard_*.py) on our engine,
each against one process on the same global batch (fsdp2_port_common.compare). The FSDP2 test each one ports is
named in its docstring."""

from __future__ import annotations

import collections

import torch
from torch import nn

from tests.fsdp2_port_common import MLP, compare


# -- test_fully_shard_autograd.py ----------------------------------------------------------------------------------
class Lin1(nn.Linear):
    pass


class Lin2(nn.Linear):
    pass


class DoubleLinear(nn.Module):
    """common_fsdp.DoubleLinear: two linears on the same input, both outputs returned (or the first only)."""

    def __init__(self, dim: int = 8, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1, self.lin2 = Lin1(dim, dim), Lin2(dim, dim)
        self.use_second_linear = use_second_linear

    def forward(self, x):
        if self.use_second_linear:
            return torch.relu(self.lin1(x)), torch.relu(self.lin2(x))
        return torch.relu(self.lin1(x))


def unused_forward_output(rank: int, world: int, mode: str) -> None:
    """test_unused_forward_output: both outputs in the loss for 3 steps, then the first only (lin2, in the root
    unit, gets no gradient)."""
    def step(model, x, i, side):
        out1, out2 = model(x)
        loss = (out1 * out2).sum() if i < 3 else out1.sum()
        loss.backward()
        return loss

    compare(rank, world, DoubleLinear, step, f"unused_forward_output/{mode}", steps=6, mode=mode, units=["Lin1"])


def unused_forward_module(rank: int, world: int, mode: str) -> None:
    """test_unused_forward_module: lin2 is a unit never called."""
    def step(model, x, i, side):
        loss = model(x).sum()
        loss.backward()
        return loss

    compare(rank, world, lambda: DoubleLinear(use_second_linear=False), step, f"unused_forward_module/{mode}",
            mode=mode, units=["Lin1", "Lin2"])


class Contained(nn.Module):
    """test_nontensor_activations' Module: takes and returns its activation in a container."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, inp):
        f = lambda x: torch.relu(self.lin2(torch.relu(self.lin1(x))))  # noqa: E731
        if isinstance(inp, list):
            return [f(inp[0])]
        if isinstance(inp, tuple) and hasattr(inp, "_fields"):
            return type(inp)(f(inp[0]), *inp[1:])
        if isinstance(inp, tuple):
            return (f(inp[0]),)
        return {"x": f(inp["x"])}


NT = collections.namedtuple("NT", "x y")


class Containers(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(Contained() for _ in range(3))

    def forward(self, x):
        h = {"list": lambda: [x], "namedtuple": lambda: NT(x, torch.ones_like(x)), "tuple": lambda: (x,),
             "dict": lambda: {"x": x}}[self.kind]()
        for block in self.blocks:
            h = block(h)
        return h["x"] if self.kind == "dict" else h[0]


def nontensor_activations(rank: int, world: int, mode: str) -> None:
    """test_nontensor_activations: units taking and returning list, namedtuple, tuple and dict activations."""
    def step(model, x, i, side):
        loss = model(x).sum()
        loss.backward()
        return loss

    for kind in ("list", "namedtuple", "tuple", "dict"):
        compare(rank, world, lambda: Containers(kind), step, f"nontensor/{kind}/{mode}", steps=3, mode=mode,
                units=["Contained"])


# -- test_fully_shard_frozen.py --------------------------------------------------------------------------------------
class MultiForward(nn.Module):
    """test_multi_forward_mixed_requires_grad's module: a trainable layer called three times with gradients and
    three times under no_grad, a frozen layer called three times, each a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_0, self.layer_no_grad, self.layer_with_grad = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(torch.relu(self.layer_with_grad(x)))
            with torch.no_grad():
                x += torch.relu(self.layer_with_grad(x))
        return x


def multi_forward_mixed_requires_grad(rank: int, world: int, mode: str) -> None:
    def step(model, x, i, side):
        loss = model(x).sum()
        loss.backward()
        return loss

    compare(rank, world, MultiForward, step, f"multi_forward_mixed/{mode}", steps=6, mode=mode, units=["Linear"])


def bitfit_frozen_after_sharding(rank: int, world: int, mode: str, checkpointing: bool) -> None:
    """test_train_mixed_requires_grad_per_group (freeze_after_init): biases only trained (BitFit), the weights frozen
    through the sharded model's named_parameters() after sharding, with and without activation checkpointing."""
    def freeze(model, i):
        if i == 0:
            for name, p in model.named_parameters():
                if "bias" not in name:
                    p.requires_grad_(False)

    def step(model, x, i, side):
        loss = model(x).sum()
        loss.backward()
        return loss

    compare(rank, world, lambda: nn.Sequential(*(MLP() for _ in range(3))), step,
            f"bitfit/{mode}/ckpt={checkpointing}", steps=5, mode=mode, units=["MLP"], before_step=freeze,
            activation_checkpointing=checkpointing)


def frozen_across_units(rank: int, world: int, mode: str) -> None:
    """test_train_mixed_requires_grad_across_groups (unfreeze_params): every other linear (a unit) frozen, a step
    run under no_grad, the frozen ones unfrozen at the last step."""
    def build():
        layers = []
        for _ in range(6):
            layers += [nn.Linear(8, 8), nn.ReLU()]
        return nn.Sequential(*layers)

    def freeze(model, i):
        for j in range(0, 12, 4):
            model[j].requires_grad_(i == 3)  # frozen at steps 0-2, unfrozen at the last

    def step(model, x, i, side):
        if i == 1:
            with torch.no_grad():
                return model(x).sum()
        loss = model(x).sum()
        loss.backward()
        return loss

    compare(rank, world, build, step, f"frozen_across_units/{mode}", steps=4, mode=mode, units=["Linear"],
            before_step=freeze)


# -- test_fully_shard_training.py ------------------------------------------------------------------------------------
class Inner(nn.Linear):
    pass


class MultiForwardModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = Inner(8, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def multi_forward_module(rank: int, world: int, mode: str) -> None:
    """test_multi_forward_module: a unit called twice in one forward, gradients zeroed to tensors on odd steps."""
    def step(model, x, i, side):
        loss = model(x).sum()
        loss.backward()
        return loss

    compare(rank, world, MultiForwardModule, step, f"multi_forward_module/{mode}", steps=6, mode=mode,
            units=["Inner"])
