"""A LightningModule for next-token language modelling, with weight decay off for biases and norms."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class LitLanguageModel(L.LightningModule):
    def __init__(self, model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1, warmup_steps: int = 10) -> None:
        super().__init__()
        self.model = model
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def _evaluate(self, batch: torch.Tensor, prefix: str) -> None:
        loss = self._loss(batch)
        self.log(f"{prefix}_loss", loss, sync_dist=True)
        self.log(f"{prefix}_ppl", torch.exp(loss), sync_dist=True)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        # by shape, as nanoGPT does: under ShardStrategy, configure_optimizers sees the parameters' real shapes
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr, betas=(0.9, 0.95),
        )
        warmup = max(1, self.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
