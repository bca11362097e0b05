"""The LightningModule, data and helpers of the ported Lightning strategy tests (``lightning_port_scenarios.py`` runs
them): Lightning's ``TestBoringModel`` of ``test_fsdp.py``, Trainers as those tests build them, and comparisons with
ddp (fp32: 1e-5 relative, 1e-6 absolute)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.checkpoint.full import full_state_dict

SAMPLES, FEATURES, BATCH = 32, 32, 4  # 4 steps an epoch on each of 2 ranks
UNITS = ["Linear"]


def dataset(seed: int = 1, n: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, 2, (n,), generator=g))


def loader(seed: int = 1, n: int = SAMPLES) -> DataLoader:
    return DataLoader(dataset(seed, n), batch_size=BATCH)


class BoringNet(L.LightningModule):
    """Lightning's TestBoringModel (``test_fsdp.py``): Linear(32, 32), ReLU, Linear(32, 2), AdamW, with a scheduler,
    logged losses and metrics in every loop, and the per-step losses kept (averaged over the ranks) to compare."""

    def __init__(self, lr: float = 0.1, build_in: str = "init") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer: Optional[nn.Module] = None
        if build_in == "init":
            self.layer = self.build()
        self.losses: list[float] = []

    @staticmethod
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x):
        return self.layer(x)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer(strategy: Any, root: Path, **options: Any) -> L.Trainer:
    settings = dict(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(root),
                    enable_checkpointing=False, deterministic=True)
    settings.update(options)
    return L.Trainer(strategy=strategy, **settings)


def shard(**options: Any) -> ShardStrategy:
    return ShardStrategy(**{"units": UNITS, **options})


def state_of(trainer_: L.Trainer) -> dict[str, torch.Tensor]:
    """The whole model's state on every rank, under either strategy."""
    if isinstance(trainer_.strategy, ShardStrategy):
        return full_state_dict(trainer_.strategy.runtime, rank0_only=False)
    return {k: v.detach().clone() for k, v in trainer_.lightning_module.state_dict().items()}


def assert_same(ours: dict, reference: dict, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert list(ours) == list(reference), f"{what}: keys {list(ours)} != {list(reference)}"
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{what} {k}: {m}")


def assert_metrics(ours: Any, reference: Any, what: str) -> None:
    ours, reference = (ours, reference) if isinstance(ours, list) else ([ours], [reference])
    for a, b in zip(ours, reference):
        assert a.keys() == b.keys(), f"{what}: {a.keys()} != {b.keys()}"
        for key in b:
            torch.testing.assert_close(torch.as_tensor(a[key]), torch.as_tensor(b[key]), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"{what} {k}: {m}")


def broadcast_path(path: Path) -> Path:
    holder = [str(path)]
    dist.broadcast_object_list(holder, 0)
    return Path(holder[0])


# name -> scenario(rank, world, its own directory); each lightning_port_*.py registers its own
SCENARIOS: dict[str, Callable[[int, int, Path], dict]] = {}


def scenario(fn: Callable[[int, int, Path], dict]) -> Callable[[int, int, Path], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn
