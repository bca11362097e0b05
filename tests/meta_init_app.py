"""A model several times larger than a rank's share, built on the meta device through Lightning: each rank
materialises only its shards. Writes per-rank peak memory growth during setup and a fingerprint of the
initialised weights."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_shard import ShardStrategy  # noqa: E402
from lightning_shard.tools.bench_checkpoint import PeakRSS  # noqa: E402
from lightning_shard.checkpoint.full import full_state_dict  # noqa: E402

WIDTH, HIDDEN, DEPTH = 1024, 2048, 24  # 100.8M parameters: 403 MB in fp32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class BigModel(L.LightningModule):
    def __init__(self, build_now: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(*(Block() for _ in range(DEPTH))) if build_now else None
        self.report: dict = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(*(Block() for _ in range(DEPTH)))

    def on_fit_start(self) -> None:  # the strategy has sharded the model
        self.peak.__exit__(None, None, None)  # sampled resident memory, from just before fit() to now
        self.report["peak_setup_mb"] = self.peak.growth_mb
        self.report["meta_left"] = [n for n, p in self.named_parameters() if p.is_meta]
        state = full_state_dict(self.trainer.strategy.runtime)  # every rank gathers; rank 0 keeps it
        self.report["fingerprint"] = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in state.items()}
        self.report["stats"] = {k: (v.mean().item(), v.std().item() if v.numel() > 1 else 0.0) for k, v in state.items()}
        self.report["model_mb"] = sum(v.numel() for v in state.values()) * 4 / 2**20

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.report.setdefault("losses", []).append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--init-module", action="store_true", help="build in trainer.init_module(empty_init=True)")
    args = parser.parse_args()
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=ShardStrategy(units=[Block]),
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    if args.init_module:
        with trainer.init_module(empty_init=True):
            model = BigModel(build_now=True)
        assert all(p.is_meta for p in model.parameters())
    else:
        model = BigModel()
    model.peak = PeakRSS().__enter__()
    inputs = torch.randn(4 * args.devices, 4, WIDTH, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(inputs), batch_size=4)
    trainer.fit(model, data)
    peaks = trainer.strategy.all_gather(torch.tensor(model.report["peak_setup_mb"]))
    if trainer.is_global_zero:
        torch.save({**model.report, "peak_setup_mb": peaks.tolist()}, os.path.join(args.out, "meta_init.pt"))


if __name__ == "__main__":
    main()
