"""Units taking and returning plain dataclasses (not registered with pytree), run in a gloo world against one process
on the same global batch: the hooks walk into them as FSDP2 does."""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch
from torch import nn

from lightning_shard.engine.shard_module import shard_module
from tests.exactness_scenarios import assert_matches


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    scale: float = 1.0
    seen: Optional[torch.dtype] = dataclasses.field(default=None, init=False)  # outside __init__


@dataclasses.dataclass(frozen=True)
class Pair:
    inner: Hidden
    residual: torch.Tensor


class Blk(nn.Module):
    """Takes a frozen dataclass holding another, returns a plain one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 7)

    def forward(self, pair: Pair) -> Hidden:
        out = Hidden(torch.tanh(self.lin(pair.inner.h)) * pair.inner.scale + pair.residual)
        out.seen = pair.inner.h.dtype
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(Blk() for _ in range(3))
        self.out = nn.Linear(7, 1)
        self.seen: list = []

    def forward(self, x):
        state = Hidden(self.inp(x), scale=0.5)
        for block in self.blocks:
            state = block(Pair(state, state.h))
            self.seen.append(state.seen)
        return self.out(state.h)


def dataclass_io(rank: int, world: int, cases: list[tuple[str, bool, Optional[torch.dtype]]]) -> list:
    """Per (sharding, activation checkpointing, compute dtype): three Adam steps against one process (fp32), or, in a
    lower dtype, the dtype each block saw inside the dataclass (the unit casts what it is given there too)."""
    done = []
    for sharding, checkpointing, dtype in cases:
        torch.manual_seed(0)
        reference = Net()
        model = copy.deepcopy(reference)
        runtime = shard_module(model, sharding=sharding, units=["Blk"], activation_checkpointing=checkpointing,
                               param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(2 * world, 5, generator=g)
            model(x.chunk(world)[rank]).float().pow(2).mean().backward()
            reference(x).pow(2).mean().backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            runtime.after_optimizer_step()
        if dtype is None:
            assert_matches(runtime, reference, f"{sharding} checkpointing={checkpointing}")
        else:
            assert set(model.seen) == {dtype}, model.seen
        done.append((sharding, checkpointing, dtype))
    return done
