"""A Lightning app run by tests/test_ema.py as a script (Trainer(devices=2) on CPU re-launches it for rank 1): the same
model trained with one of Lightning's weight-averaging callbacks under DDP and with its sharded counterpart under
ShardStrategy (EMAWeightAveraging and ShardedEMA; WeightAveraging and ShardedWeightAveraging, equal average or a
multi_avg_fn), then rank 0 saves what each run produced (losses, validation losses, final weights, checkpoint paths)
for the test to compare."""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging
from torch.optim.swa_utils import get_ema_multi_avg_fn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_shard import ShardedEMA, ShardedWeightAveraging, ShardStrategy  # noqa: E402
from lightning_shard.checkpoint.full import full_state_dict  # noqa: E402
from tests.world import leave_lightning_app  # noqa: E402

# when the average is updated: from the third optimizer step on, every second one, and at each epoch's end
WHEN = {"decay": 0.8, "update_every_n_steps": 2, "update_starting_at_step": 2, "update_starting_at_epoch": 1}


def averagings(kind: str, use_buffers: bool) -> tuple:
    """(Lightning's callback, a factory of ours): ``ema``; ``swa``, the equal average after every step (torch's
    per-tensor expression on the CPU); ``multi``, a multi_avg_fn (an EMA by ``_foreach_lerp_``) after every step."""
    if kind == "ema":
        when = {**WHEN, "use_buffers": use_buffers}
        return EMAWeightAveraging(**when), lambda: ShardedEMA(**when)
    options = {"use_buffers": use_buffers, **({"multi_avg_fn": get_ema_multi_avg_fn(0.8)} if kind == "multi" else {})}
    return WeightAveraging(**options), lambda: ShardedWeightAveraging(**options)


class LitEMA(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        # odd widths (padding at 2 ranks); a batch norm: floating buffers and an integer one (num_batches_tracked)
        self.net = nn.Sequential(nn.Linear(7, 13, bias=False), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13, 13), nn.ReLU(),
                                 nn.Linear(13, 1))
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).square().mean()
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", (self.net(x) - y).square().mean(), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.val_losses.append(self.trainer.callback_metrics["val_loss"].item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def loader(seed: int, n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 7, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)


def run(strategy, averaging, epochs: int, out: str, resume: str | None = None) -> dict:
    torch.manual_seed(0)
    module = LitEMA()
    # a checkpoint at each epoch's end (inside fit: the weights trained and their average differ) and the last one,
    # saved when training ends
    saving = ModelCheckpoint(dirpath=out, filename="{epoch}", save_last=True, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                        callbacks=[averaging, saving], enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True)
    trainer.fit(module, loader(1), loader(2), ckpt_path=resume)
    state = (full_state_dict(trainer.strategy.runtime) if isinstance(strategy, ShardStrategy)
             else {k: v.clone() for k, v in module.state_dict().items()})
    return {"losses": module.losses, "val_losses": module.val_losses, "state": state,
            "checkpoint": os.path.join(out, "last.ckpt")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sharding", nargs="+", default=["full"])
    parser.add_argument("--state-dict-type", default="sharded", choices=["sharded", "full"])
    parser.add_argument("--resume", action="store_true", help="also run 1 epoch, then resume to 3")
    parser.add_argument("--offload", default=None)
    parser.add_argument("--keep-gathered-in-eval", action="store_true")
    parser.add_argument("--no-buffers", action="store_true", help="use_buffers=False: buffers followed, not averaged")
    parser.add_argument("--average", default="ema", choices=["ema", "swa", "multi"])
    args = parser.parse_args()

    lightnings, ours = averagings(args.average, use_buffers=not args.no_buffers)
    results = {"ddp": run("ddp", lightnings, 3, os.path.join(args.out, "ddp"))}
    for sharding in args.sharding:
        def strategy() -> ShardStrategy:
            return ShardStrategy(sharding=sharding, state_dict_type=args.state_dict_type, unit_size=100,
                                 offload=args.offload, keep_gathered_in_eval=args.keep_gathered_in_eval)

        out = os.path.join(args.out, sharding)
        results[sharding] = run(strategy(), ours(), 3, out)
        if args.resume:  # from the checkpoint saved as the first fit ended
            first = run(strategy(), ours(), 1, out + "_first")
            resumed = run(strategy(), ours(), 3, out + "_resumed", resume=first["checkpoint"])
            results[f"{sharding}_resumed"] = {**resumed, "losses": first["losses"] + resumed["losses"],
                                              "val_losses": first["val_losses"] + resumed["val_losses"]}
    leave_lightning_app(results, args.out)


if __name__ == "__main__":
    main()
