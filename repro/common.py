"""Shared bits of the async_save review's reproductions: a tiny GPT LightningModule, fits through the real Trainer,
and writers slowed/failed in the ranks' processes."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard.checkpoint import async_save
from tests.models import TinyGPT
from tests.world import as_lightning_rank  # noqa: F401

SAMPLES = 48  # 6 steps on 2 ranks, batch 4


def module_class(optimizer: str = "adamw", scheduler: str = "step", val: bool = False):
    import lightning as L

    class GPTModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            loss = TinyGPT.loss(self.model, tokens, batch_idx)
            self.losses.append(float(self.all_gather(loss.detach()).mean()))
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            (tokens,) = batch
            self.log("val_loss", TinyGPT.loss(self.model, tokens, batch_idx), sync_dist=True)

        def configure_optimizers(self):
            if optimizer == "adamw":
                opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            elif optimizer == "amsgrad":
                opt = torch.optim.Adam(self.parameters(), lr=1e-2, amsgrad=True)
            elif optimizer == "sgd":
                opt = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
            elif optimizer == "adagrad":
                opt = torch.optim.Adagrad(self.parameters(), lr=1e-2)
            else:
                raise ValueError(optimizer)
            if scheduler == "step":
                return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]
            if scheduler == "onecycle":
                return [opt], [{"scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20),
                                "interval": "step"}]
            return opt

    return GPTModule


def loader(n: int = SAMPLES) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(TinyGPT.batch(g, n)), batch_size=4)


def trainer(world: int, strategy: Any, callbacks: list, **kw: Any):
    import lightning as L

    kw.setdefault("max_steps", 6)
    return L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, deterministic=True,
                     **kw)


def slow_writes(delay: float) -> None:
    """Every background write sleeps ``delay`` s first (a step or more runs meanwhile)."""
    original = async_save.StagedWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(delay)
        return original(self, plan, planner)

    async_save.StagedWriter.write_data = write_data


def fail_write(rank: int, on_rank: int, at: int, delay: float = 0.0, kill: bool = False) -> None:
    """``on_rank``'s ``at``-th background write raises ENOSPC (or the process is SIGKILLed) after ``delay`` s."""
    original = async_save.StagedWriter.write_data
    count = {"n": 0}

    def write_data(self, plan, planner):
        count["n"] += 1
        if rank == on_rank and count["n"] == at:
            time.sleep(delay)
            if kill:
                import signal
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(28, "No space left on device (injected)")
        return original(self, plan, planner)

    async_save.StagedWriter.write_data = write_data


def listing(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir()) if os.path.isdir(directory) else []
