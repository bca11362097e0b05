"""A tiny 2-rank CPU fit run as a script by tests/test_exit.py: the test checks only that every process exits
cleanly, code 0, once the fit has finished. Launched plainly, Trainer(devices=2) re-launches it for rank 1;
with LOCAL_RANK etc. set (as the test does), each rank is started from outside, so each exit code is seen."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_shard import ShardStrategy  # noqa: E402
from tests.models import TinyGPT  # noqa: E402


class LitTiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT()

    def training_step(self, batch, batch_idx):
        loss = TinyGPT.loss(self.model, batch[0], batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="batches per epoch and rank")
    parser.add_argument("--linger-rank", type=int, default=None, help="this rank exits after the others...")
    parser.add_argument("--linger", type=float, default=0.5, help="...by this many seconds")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(TinyGPT.batch(torch.Generator().manual_seed(1), 2 * 4 * args.steps))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ShardStrategy(), max_epochs=args.epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out,
    )
    trainer.fit(LitTiny(), DataLoader(data, batch_size=4))
    if trainer.global_rank == args.linger_rank:  # its peers exit, and close their sockets, while it is alive
        time.sleep(args.linger)


if __name__ == "__main__":
    main()
