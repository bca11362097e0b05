"""A Lightning app run by the Lightning tests as a script (Trainer(devices=N) on CPU re-launches the
script for the other ranks). It trains the same model under DDP and under ShardStrategy in one
process group, then rank 0 saves what each run produced for the test to compare."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.utilities import grad_norm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_shard import ShardStrategy  # noqa: E402
from lightning_shard.checkpoint.full import full_state_dict  # noqa: E402
from tests.models import SlowAdamW, TinyGPT  # noqa: E402
from tests.world import leave_lightning_app  # noqa: E402


class LitGPT(L.LightningModule):
    def __init__(self, manual: bool = False, clip: float | None = None, optimizer: str = "adamw",
                 adamw_implementation: str | None = None) -> None:
        super().__init__()
        self.model = TinyGPT()
        self.automatic_optimization, self.clip, self.optimizer = not manual, clip, optimizer
        # AdamW's kernel as the user would choose it: None (torch's default), "foreach" or "fused"
        self.adamw_options = {adamw_implementation: True} if adamw_implementation else {}
        self.grad_norms: list[float] = []  # manual optimization: the total gradient norm before clipping
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=37, average="micro")
        self.test_mean = torchmetrics.MeanMetric()
        self.step_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = TinyGPT.loss(self.model, tokens, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        self.step_losses.append(self.all_gather(loss.detach()).mean().item())
        if not self.automatic_optimization:
            opts, schedulers = self.optimizers(), self.lr_schedulers()
            opts, schedulers = (opts, schedulers) if isinstance(opts, list) else ([opts], [schedulers])
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            strategy = self.trainer.strategy
            norms = strategy.grad_norm(2) if isinstance(strategy, ShardStrategy) else grad_norm(self, 2)
            self.grad_norms.append(norms["grad_2.0_norm_total"].item())
            for opt in opts:
                if self.clip is not None:
                    self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
                opt.step()
            for scheduler in schedulers:
                scheduler.step()
            # a second forward in the same step, after the optimizer changed the shards
            self.log("post_step_loss", TinyGPT.loss(self.model, tokens, batch_idx).detach(), sync_dist=True)
            return None
        return loss

    def validation_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        self.val_acc(logits.argmax(-1).reshape(-1), tokens[:, 1:].reshape(-1))
        self.log("val_loss", TinyGPT.loss(self.model, tokens, batch_idx), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        (tokens,) = batch
        self.test_mean(TinyGPT.loss(self.model, tokens, batch_idx))
        self.log("test_loss", self.test_mean)

    def predict_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(tokens[:, :-1]).argmax(-1)

    def configure_optimizers(self):
        # by shape, as nanoGPT and torch's Muon docs do: under ShardStrategy the parameters have their real
        # shapes here too
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
        if self.optimizer == "muon":  # Muon for the matrices, AdamW for the rest: two optimizers (manual)
            opts = [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01),
                    torch.optim.AdamW(others, lr=1e-2, **self.adamw_options)]
        elif self.optimizer == "adafactor":
            opts = [torch.optim.Adafactor(groups, lr=1e-2)]
        elif self.optimizer == "slow adamw":  # (a host slower than its device: tests/models.py)
            opts = [SlowAdamW(groups, lr=1e-2, **self.adamw_options)]
        else:
            opts = [torch.optim.AdamW(groups, lr=1e-2, **self.adamw_options)]
        return opts, [torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5) for opt in opts]


class CrashAt(L.Callback):
    """kill -9 of rank 1 when a given step starts: a crash, not a clean stop."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def loader(seed: int, n: int = 96) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(TinyGPT.batch(g, n)), batch_size=4)


def run(strategy, args, max_epochs: int, ckpt_dir: str, resume: str | None = None, crash_at: int | None = None) -> dict:
    torch.manual_seed(0)
    module = LitGPT(manual=args.manual, clip=args.clip, optimizer=args.optimizer)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, max_epochs=max_epochs,
        accumulate_grad_batches=1 if args.manual else args.accumulate,
        gradient_clip_val=None if args.manual else args.clip, gradient_clip_algorithm=args.clip_algorithm,
        logger=L.pytorch.loggers.CSVLogger(ckpt_dir, name="logs"), enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)]
        + ([CrashAt(crash_at)] if crash_at is not None else []),
        num_sanity_val_steps=0, deterministic=True, log_every_n_steps=1,
    )
    trainer.fit(module, loader(1), loader(2), ckpt_path=resume)
    val = trainer.validate(module, loader(2), verbose=False)[0]
    test = trainer.test(module, loader(3), verbose=False)[0]
    predictions = torch.cat(trainer.predict(module, loader(3)))
    state = (full_state_dict(trainer.strategy.runtime) if isinstance(strategy, ShardStrategy) else module.state_dict())
    return {"losses": module.step_losses, "grad_norms": module.grad_norms, "state": state, "val": val, "test": test, "predict": predictions,
            "comm": trainer.strategy.comm_stats if isinstance(strategy, ShardStrategy) else {}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1, help="launched once per node, with NODE_RANK set")
    parser.add_argument("--sharding", nargs="+", default=["full", "grad_op", "none"])
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--clip-algorithm", default="norm")
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adafactor", "muon"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="also run: 1 epoch, then resume to --epochs")
    parser.add_argument("--resume-from", default=None, help="resume the shard runs from this checkpoint")
    parser.add_argument("--crash-at-step", type=int, default=None, help="kill -9 rank 1 at this step")
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--state-dict-type", default="sharded", choices=["sharded", "full"])
    parser.add_argument("--keep-gathered-in-eval", action="store_true")
    parser.add_argument("--compile", action="store_true", help="ShardStrategy(compile=True)")
    args = parser.parse_args()

    results = {} if args.skip_ddp else {"ddp": run("ddp", args, args.epochs, os.path.join(args.out, "ddp"))}
    for sharding in args.sharding:
        ckpt_dir = os.path.join(args.out, sharding)
        strategy = ShardStrategy(sharding=sharding, state_dict_type=args.state_dict_type,
                                 keep_gathered_in_eval=args.keep_gathered_in_eval, compile=args.compile)
        results[sharding] = run(strategy, args, args.epochs, ckpt_dir, resume=args.resume_from, crash_at=args.crash_at_step)
        if args.resume:
            first = run(ShardStrategy(sharding=sharding, state_dict_type=args.state_dict_type), args, 1, ckpt_dir + "_resume")
            resumed = run(ShardStrategy(sharding=sharding, state_dict_type=args.state_dict_type), args, args.epochs, ckpt_dir + "_resume",
                          resume=os.path.join(ckpt_dir + "_resume", "last.ckpt"))
            results[f"{sharding}_resumed"] = {**resumed, "losses": first["losses"] + resumed["losses"]}
    leave_lightning_app(results, args.out)


if __name__ == "__main__":
    main()
