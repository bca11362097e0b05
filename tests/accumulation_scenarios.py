"""Gradient accumulation through real Trainers (accumulate_grad_batches, or manual optimization under
``block_backward_sync()``) with ``reduce_during_accumulation=False``, where a ``zero_grad`` between micro-batches must
drop what ``no_sync()`` held as DDP's drops its ``.grad`` (engine/runtime/no_sync_marks.py). Each scenario runs
ShardStrategy and Lightning's ddp on the same data and seeds in one gloo world (fp32: rtol 1e-5, atol 1e-6)."""

from __future__ import annotations

import logging
import traceback
import warnings
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from tests.lightning_port_models import assert_same, state_of
from tests.world import as_lightning_rank


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin, self.ln = nn.Linear(dim, dim), nn.LayerNorm(dim)

    def forward(self, x):
        return x + self.ln(torch.tanh(self.lin(x)))


class BitFit(L.LightningModule):
    """Only biases and LayerNorms train (BitFit): at 2 and 3 ranks rank 0 holds none of them (its shards of every
    unit are frozen weights), so its marks are all empty; ``clip_grad_norm_`` in ``on_after_backward``, after every
    micro-batch, writes them (keeping their values) and must not drop its micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, 16), nn.Sequential(*(Block() for _ in range(3))), nn.Linear(16, 2)
        for module in (self.inp, self.out, *(block.lin for block in self.blocks)):
            module.weight.requires_grad_(False)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_after_backward(self) -> None:
        torch.nn.utils.clip_grad_norm_([p for p in self.parameters() if p.requires_grad], 1e6)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


class Gan(L.LightningModule):
    """Manual optimization, windows of 3 micro-batches under ``block_backward_sync()``: the discriminator's gradients
    are zeroed before each micro-batch (only its window's last counts, as under DDP), and each loss trains one
    network (``toggle_optimizer``): the generator's backward, in which the discriminator is frozen, came between."""

    def __init__(self, window: int = 3) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d = nn.Sequential(Block(), Block()), nn.Sequential(Block(), nn.Linear(16, 1))
        self.window = window

    def training_step(self, batch, batch_idx):
        x = batch[0].repeat(1, 2)
        opt_g, opt_d = self.optimizers()
        last = (batch_idx + 1) % self.window == 0
        with nullcontext() if last else self.trainer.strategy.block_backward_sync():
            opt_d.zero_grad()
            self.toggle_optimizer(opt_d)
            self.manual_backward(self.d(x).pow(2).mean() + self.d(self.g(x).detach()).mean())
            self.untoggle_optimizer(opt_d)
            self.toggle_optimizer(opt_g)
            self.manual_backward(-self.d(self.g(x)).mean())
            self.untoggle_optimizer(opt_g)
        if last:
            opt_g.step()
            opt_d.step()
            opt_g.zero_grad()
            opt_d.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.g.parameters(), lr=1e-2), torch.optim.AdamW(self.d.parameters(), lr=1e-2)


def _fit(world: int, strategy, root: Path, module: L.LightningModule, **options) -> L.Trainer:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(36, 8, generator=g), torch.randint(0, 2, (36,), generator=g))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=str(root), deterministic=True, **options)
    trainer.fit(module, DataLoader(data, batch_size=2))
    return trainer


def _against_ddp(world: int, root: Path, build, ddp: str = "ddp", shard=None, **options) -> dict:
    torch.manual_seed(0)
    ours = _fit(world, ShardStrategy(units=["Block"], reduce_during_accumulation=False, **(shard or {})), root / "shard",
                build(), **options)
    torch.manual_seed(0)
    reference = _fit(world, ddp, root / "ddp", build(), **options)
    assert_same(state_of(ours), state_of(reference), "against ddp")
    return {"steps": ours.global_step}


SCENARIOS = {
    "bitfit_clip_after_each_micro_batch": lambda w, root: _against_ddp(w, root, BitFit, accumulate_grad_batches=3),
    "bitfit_clip_offload_params": lambda w, root: _against_ddp(w, root, BitFit, shard={"offload": "params"},
                                                               accumulate_grad_batches=3, gradient_clip_val=0.05),
    "gan_zero_grad_of_one_optimizer_toggled": lambda w, root: _against_ddp(w, root, Gan,
                                                                           ddp="ddp_find_unused_parameters_true"),
}


def run(rank: int, world: int, names: list[str], root: str) -> dict[str, str]:
    as_lightning_rank(rank, world)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    out = {}
    for name in names:
        try:
            SCENARIOS[name](world, Path(root) / name)
            out[name] = "ok"
        except Exception as err:  # noqa: BLE001 (reported to the test, which fails naming it)
            out[name] = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-3)}"
        dist.barrier()
    return out
