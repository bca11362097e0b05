"""A model whose state-dict hooks rename and reshape its keys, sharded in a gloo world (see world.py): its full
state dict must be the plain model's ``state_dict()``, and the plain model's state dict must load into it."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from lightning_shard.checkpoint import sharded
from lightning_shard.checkpoint.full import full_state_dict, load_full_state_dict
from lightning_shard.checkpoint.io import save_sharded
from lightning_shard.engine.shard_module import shard_module


def _save_kernel(module, state, prefix, local_metadata):  # private state-dict hook: may return a new dict
    state[prefix + "kernel"] = state.pop(prefix + "weight")
    state[prefix + "gain"] = state.pop(prefix + "scale")


def _load_kernel(state, prefix, local_metadata, strict, missing, unexpected, errors):
    for old, new in (("kernel", "weight"), ("gain", "scale")):
        if prefix + old in state:
            state[prefix + new] = state.pop(prefix + old)


class Kernel(nn.Module):
    """Saves ``weight`` as ``kernel`` and the buffer ``scale`` as ``gain``; its load pre-hook maps them back."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)
        self.register_buffer("scale", torch.rand(n_out) + 0.5)
        self._register_state_dict_hook(_save_kernel)
        self._register_load_state_dict_pre_hook(_load_kernel)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * self.scale


def _load_transposed(module, state, prefix, local_metadata, strict, missing, unexpected, errors):
    if prefix + "weight_t" in state:
        state[prefix + "weight"] = state.pop(prefix + "weight_t").t()


class Transposed(nn.Module):
    """Stores its weight transposed (``_save_to_state_dict``), and transposes it back on load (public pre-hook)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2 * n, n) / n**0.5)
        self.register_load_state_dict_pre_hook(_load_transposed)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight_t"] = destination.pop(prefix + "weight").t()

    def forward(self, x):
        return x @ self.weight.t()


class Block(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(n)
        self.kernel = Kernel(n, 2 * n)
        self.up = Transposed(n)
        self.down = nn.Linear(2 * n, n)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.tanh(self.kernel(h) + self.up(h)))


def _save_root(module, state, prefix, local_metadata):  # public post-hook: in place, returns None
    state[prefix + "embedding.table"] = state.pop(prefix + "embed.weight")


def _load_root(module, state, prefix, local_metadata, strict, missing, unexpected, errors):
    if prefix + "embedding.table" in state:
        state[prefix + "embed.weight"] = state.pop(prefix + "embedding.table")


class HookedNet(nn.Module):
    """Hooks at three depths, a tied head (saved under both names), a unit per block plus the root unit."""

    def __init__(self, vocab: int = 11, n: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, n)
        self.blocks = nn.ModuleList(Block(n) for _ in range(2))
        self.head = nn.Linear(n, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_state_dict_post_hook(_save_root)
        self.register_load_state_dict_pre_hook(_load_root)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _compare(full: dict, plain: dict, what: str) -> None:
    assert list(full) == list(plain), f"{what}: keys {list(full)} != {list(plain)}"
    for name, value in plain.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{what} {n}: {m}")


@torch.no_grad()
def full_round_trip(rank: int, world: int, directory: str):
    """full_state_dict == plain state_dict(); a changed plain state dict loads (and computes) as in the plain
    model; and what a sharded checkpoint of it holds, keyed as it is written (checked by the test)."""
    torch.manual_seed(0)
    plain = HookedNet()
    model = copy.deepcopy(plain)
    runtime = shard_module(model, sharding="full", units=["Block"])
    _compare(full_state_dict(runtime, rank0_only=False), plain.state_dict(), "before loading:")
    kept = full_state_dict(runtime, rank0_only=True)
    assert kept == {} if rank else list(kept) == list(plain.state_dict())
    assert model.embed.weight.shape == (runtime.units[-1].storage.shard_params[0].numel(),)  # shards again

    changed = {k: v * 1.5 + 0.25 for k, v in plain.state_dict().items()}
    plain.load_state_dict(changed)  # the plain model's own hooks, for reference
    load_full_state_dict(runtime, changed)
    _compare(full_state_dict(runtime, rank0_only=False), plain.state_dict(), "after loading:")
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(tokens), plain(tokens))

    path = Path(directory) / "sharded"
    save_sharded({"state_dict": sharded.model_state(runtime), "optimizer_states": []}, path)
    return {"keys": list(plain.state_dict()), "plain": {k: v.clone() for k, v in plain.state_dict().items()}}
