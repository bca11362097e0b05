"""A LightningModule for sequence classification with torchmetrics accuracy and macro F1."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


class LitClassifier(L.LightningModule):
    def __init__(self, model: nn.Module, num_classes: int = 3, lr: float = 5e-5, weight_decay: float = 0.01,
                 warmup_steps: int = 20) -> None:
        super().__init__()
        self.model = model
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        metrics = lambda: torchmetrics.MetricCollection({  # noqa: E731
            "acc": torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro"),
            "f1": torchmetrics.classification.MulticlassF1Score(num_classes, average="macro"),
        })
        self.val_metrics, self.test_metrics = metrics(), metrics()

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        loss = F.cross_entropy(self.model(ids, mask), labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def _evaluate(self, batch, metrics: torchmetrics.MetricCollection, prefix: str) -> None:
        ids, mask, labels = batch
        logits = self.model(ids, mask)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, labels), sync_dist=True)
        metrics.update(logits.argmax(-1), labels)
        self.log_dict({f"{prefix}_{k}": v for k, v in metrics.items()})

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, self.val_metrics, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, self.test_metrics, "test")

    def configure_optimizers(self):
        # by shape: under ShardStrategy, configure_optimizers sees the parameters' real shapes
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.lr)
        warmup = max(1, self.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
