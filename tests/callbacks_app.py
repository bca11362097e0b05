"""A Lightning app run by tests/test_lightning_callbacks.py as a script (Trainer(devices=2) on CPU re-launches it for
rank 1): Lightning's own callbacks and habits under ShardStrategy, each a scenario (``--scenario``):

* ``refused``: what is refused at setup (or, for pruning applied by user code during fit, at the moment it runs), on
  every rank with the same error: ModelPruning, a model carrying torch.nn.utils.prune reparametrizations, a module
  added in ``configure_optimizers``, an uninitialised ``nn.LazyLinear``. Then a fit proves no rank was left waiting.
* ``consolidate``: ``if trainer.is_global_zero: consolidate(best_model_path)`` after fit, the other rank waiting in
  ``trainer.strategy.barrier()``; then again, once the other rank has exited. Both results are saved for the test to
  compare with a consolidation in a separate process.
* ``grad_norm``: Lightning's ``grad_norm(self, 2)`` logged in ``on_before_optimizer_step`` (a warning, once), then the
  strategy's ``grad_norm`` logged (no warning; DDP's numbers)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.nn.utils import prune
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from lightning.pytorch.utilities import grad_norm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_shard import ShardStrategy  # noqa: E402
from lightning_shard.checkpoint.consolidate import consolidate  # noqa: E402
from tests.world import leave_lightning_app  # noqa: E402


class LitNet(L.LightningModule):
    def __init__(self, habit: str = "") -> None:
        super().__init__()
        self.habit = habit
        first = nn.LazyLinear(16) if habit == "lazy" else nn.Linear(6, 16)
        self.net = nn.Sequential(first, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        if habit == "pruned before fit":
            prune.l1_unstructured(self.net[2], "weight", amount=0.5)
        self.norms: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_before_optimizer_step(self, optimizer):
        if self.habit == "lightning grad_norm":
            self.log_dict(grad_norm(self, norm_type=2))
        elif self.habit == "strategy grad_norm":
            strategy = self.trainer.strategy
            norms = strategy.grad_norm(2) if isinstance(strategy, ShardStrategy) else grad_norm(self, 2)
            self.log_dict(norms)
            self.norms.append({k: float(v) for k, v in norms.items()})

    def configure_optimizers(self):
        if self.habit == "added in configure_optimizers":
            self.extra = nn.Linear(1, 1)  # after sharding: its gradient would be each rank's own
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class PruneAtEpochEnd(L.Callback):
    """torch.nn.utils.prune called by the user's own code during fit (ModelPruning's way, without it)."""

    def on_train_epoch_end(self, trainer, pl_module):
        prune.l1_unstructured(pl_module.net[2], "weight", amount=0.5)


def loader(seed: int, n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


def fit(strategy, habit: str = "", callbacks=(), out: str = "", epochs: int = 2) -> tuple[LitNet, L.Trainer]:
    torch.manual_seed(0)
    module = LitNet(habit)
    saving = [ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), monitor="val_loss", save_last=True)] if out \
        else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=bool(saving), callbacks=[*callbacks, *saving], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
    trainer.fit(module, loader(1), loader(2))
    return module, trainer


def refused() -> dict:
    errors = {}
    cases = {
        "ModelPruning": ("", [ModelPruning("l1_unstructured", amount=0.5)]),
        "pruned during fit": ("", [PruneAtEpochEnd()]),
        "pruned before fit": ("pruned before fit", []),
        "added in configure_optimizers": ("added in configure_optimizers", []),
        "lazy": ("lazy", []),
    }
    for name, (habit, callbacks) in cases.items():
        try:
            fit(ShardStrategy(units=["Linear"]), habit, callbacks)
            errors[name] = "no error"
        except (ValueError, RuntimeError) as err:
            errors[name] = f"{type(err).__name__}: {err}"
    module, _ = fit(ShardStrategy(units=["Linear"]), epochs=1)  # every rank goes on: none waits in a collective
    return {"errors": errors}


def consolidate_on_rank_0(out: str) -> dict:
    _, trainer = fit(ShardStrategy(units=["Linear"]), out=out)
    best = trainer.checkpoint_callback.best_model_path
    results = {"best": best}
    if trainer.is_global_zero:
        results["waiting"] = consolidate(best)["state_dict"]
    trainer.strategy.barrier()  # the other rank waits here meanwhile
    if not trainer.is_global_zero:
        os._exit(0)  # and now leaves, its process group with it
    time.sleep(1)
    results["exited"] = consolidate(best)["state_dict"]
    return results


def grad_norms() -> dict:
    _, trainer = fit(ShardStrategy(units=["Linear"]), "lightning grad_norm", epochs=1)
    ddp, _ = fit("ddp", "strategy grad_norm", epochs=1)
    sharded, _ = fit(ShardStrategy(units=["Linear"]), "strategy grad_norm", epochs=1)
    return {"ddp": ddp.norms, "sharded": sharded.norms}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", required=True, choices=["refused", "consolidate", "grad_norm"])
    args = parser.parse_args()
    if args.scenario == "refused":
        results = refused()
    elif args.scenario == "consolidate":
        results = consolidate_on_rank_0(args.out)
    else:
        results = grad_norms()
    if args.scenario == "consolidate":  # the other rank has left: no barrier to meet it in
        torch.save(results, os.path.join(args.out, "results.pt"))
        torch.distributed.destroy_process_group()
        return
    leave_lightning_app(results, args.out)


if __name__ == "__main__":
    main()
