"""Small models that exercise the engine's corner cases. Sizes are chosen odd on purpose."""

from __future__ import annotations

import time

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, num_heads=1, batch_first=True, bias=False)  # key bias has zero grad
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token embedding tied with the output head, learned positions, repeated blocks."""

    def __init__(self, vocab: int = 37, d: int = 14, n_blocks: int = 3, seq: int = 9) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randint(0, 37, (n, 10), generator=generator)


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table(idx)


class Head(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class SplitTiedGPT(TinyGPT):
    """The tied embedding and head live in different units (``units=["Embed", "Head", "Block"]``)."""

    def __init__(self, vocab: int = 37, d: int = 14) -> None:
        super().__init__(vocab, d)
        del self.wte, self.head, self.ln_f
        self.embed = Embed(vocab, d)
        self.out = Head(vocab, d)
        self.out.proj.weight = self.embed.table.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Odd(nn.Module):
    """Parameters of 1, 5, 7 and 13 elements: smaller than and not divisible by the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.9))
        self.a = nn.Linear(6, 7)  # 42 + 7
        self.b = nn.Linear(7, 1)  # 7 + 1
        self.c = nn.Linear(1, 5)  # 5 + 5
        self.d = nn.Linear(5, 13, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(torch.tanh(self.a(x))))) * self.scale

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        return model(batch).pow(2).mean()

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 6, generator=generator)


class FrozenMix(nn.Module):
    """One unit mixing frozen and trainable parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(10) for _ in range(2))
        self.blocks[0].mlp[0].weight.requires_grad_(False)
        self.blocks[1].ln1.bias.requires_grad_(False)
        self.blocks[1].attn.in_proj_weight.requires_grad_(False)
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        return model(batch).pow(2).mean()

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 4, 10, generator=generator)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


class Rare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Misc(nn.Module):
    """BatchNorm buffers, parameter-free modules, a unit called twice, a unit unused on odd steps."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8, bias=False)  # a bias before BatchNorm has zero gradient
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.Sequential(nn.ReLU(), nn.Identity(), nn.Dropout(0.0))
        self.twice = Twice()
        self.rare = Rare()
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        h = self.act(self.bn(self.inp(x)))
        h = self.twice(h)
        if use_rare:
            h = self.rare(h)
        return self.out(h)

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        return model(batch, use_rare=step % 2 == 0).pow(2).mean()

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 5, generator=generator)


class Reorder(nn.Module):
    """Blocks run in a different order on odd steps: prefetching must follow, results must not change."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(10) for _ in range(3))
        self.out = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        order = self.blocks if step % 2 == 0 else list(self.blocks)[::-1]
        for block in order:
            x = block(x)
        return self.out(x)

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        return model(batch, step).pow(2).mean()

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 4, 10, generator=generator)


class UntiedLM(TinyGPT):
    """An embedding of its own (not tied): fed token ids, its backward needs no weights."""

    def __init__(self, checkpoint_blocks: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(14, 37, bias=False)
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            if self.checkpoint_blocks:  # recomputed in backward: gathered again there
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


class CheckpointedLM(UntiedLM):
    def __init__(self) -> None:
        super().__init__(checkpoint_blocks=True)


class RawInputStem(nn.Module):
    """A Conv1d and a LayerNorm applied to inputs that need no gradient: they still save their weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, kernel_size=3, padding=1)
        self.norm = nn.LayerNorm(3)
        self.out = nn.Linear(8 + 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv(x).transpose(1, 2)
        b = self.norm(x.transpose(1, 2))
        return self.out(torch.cat([a, b], dim=-1))

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        return model(batch).pow(2).mean()

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 3, 7, generator=generator)


class RawInputStack(nn.Module):
    """Blocks fed raw data (no gradient) first: merged into one unit, the first member's backward runs after the
    others', so the unit may be reduced only once all of it has run."""

    def __init__(self, d: int = 6, n_blocks: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d + 1), nn.Tanh(), nn.Linear(d + 1, d))
                                    for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        return model(batch).pow(2).mean()

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 6, generator=generator)


class CrossBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.own = nn.Linear(d, d)
        self.cross = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.own(h) + self.cross(memory))


class ViewOut(nn.Module):
    def __init__(self, d: int, keep: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.keep = keep

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h + torch.tanh(self.lin(h)))[:, :self.keep]  # a view of its result


class Halves(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        result = h + torch.tanh(self.lin(h))
        half = h.shape[1] // 2
        return result[:, :half], result[:, half:]  # two views of its result


class CrossViewOut(nn.Module):
    """Blocks fed two tensors that need gradients (their state and an encoder's output, which every block reads),
    between blocks returning views of their result, which the caller writes in place: that replaces the views'
    autograd nodes, not their base's, so each unit is still gathered for its backward."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.enc = nn.Linear(d, d)
        self.halves = Halves(d)
        self.blocks = nn.ModuleList(CrossBlock(d) for _ in range(2))
        self.view_mid = ViewOut(d, keep=d)
        self.view_out = ViewOut(d, keep=d - 1)
        self.out = nn.Linear(d - 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = torch.tanh(self.enc(x))
        first, second = self.halves(memory * 2)
        first.mul_(2)
        second.mul_(3)
        h = self.blocks[0](torch.cat([first, second], dim=1), memory)
        h = self.view_mid(h)
        h.mul_(2)
        return self.out(self.view_out(self.blocks[1](h, memory)))

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        return model(batch).pow(2).mean()

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 6, generator=generator)


class TanhBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Penalized(nn.Module):
    """A critic trained with a gradient penalty (WGAN-GP's): the loss holds the input gradient's norm, so backward
    runs through the graph of a ``create_graph=True`` backward, which reads every unit's parameters again."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.blocks = nn.ModuleList(TanhBlock(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    @staticmethod
    def loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        x = batch.clone().requires_grad_(True)
        score = model(x)
        (slope,) = torch.autograd.grad(score.sum(), x, create_graph=True)
        with torch.no_grad():  # a forward in between (a metric) frees nothing that graph reads
            model(batch)
        return score.pow(2).mean() + (slope.norm(dim=1) - 1).pow(2).mean()

    @staticmethod
    def batch(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 6, generator=generator)


class SlowAdamW(torch.optim.AdamW):
    """AdamW that takes 20 ms longer per call (a host slower than its device: each unit's step outlasts the next
    forward's use of the one before, so ``optimizer.step()`` returns before most units are stepped)."""

    @torch.no_grad()
    def step(self, closure=None):
        time.sleep(0.02)
        return super().step(closure)
