"""Ported scenarios: evaluation after fit, the strategy's collectives, ``sync_dist`` logging, sanity validation and
``sync_batchnorm`` (test_common.py, test_ddp_integration.py, test_fsdp.py)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from tests.lightning_port_models import (
    FEATURES, BoringNet, assert_metrics, assert_same, loader, scenario, shard, state_of, trainer,
)


class DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return loader(1)

    def val_dataloader(self):
        return loader(2)

    def test_dataloader(self):
        return loader(3)


@scenario
def evaluate_after_fit(rank: int, world: int, root: Path) -> dict:
    """test_common.py ``test_evaluate``: fit 2 epochs with a datamodule, then ``validate``/``test`` with no model (the
    best checkpoint of the fit): the weights do not change, and the metrics are ddp's."""
    runs = {}
    for name in ("ddp", "shard"):
        torch.manual_seed(0)
        model = BoringNet()
        t = trainer("ddp" if name == "ddp" else shard(), root / name, max_epochs=2, enable_checkpointing=True)
        dm = DataModule()
        t.fit(model, datamodule=dm)
        assert "ckpt" in t.checkpoint_callback.best_model_path
        before = state_of(t)
        runs[name] = {"validate": t.validate(datamodule=dm, verbose=False), "test": t.test(datamodule=dm, verbose=False),
                      "ckpt_path": Path(t.ckpt_path).name}
        assert_same(state_of(t), before, "weights after validate and test", 0, 0)
        runs[name]["state"] = before
    for key in ("validate", "test"):
        assert_metrics(runs["shard"][key], runs["ddp"][key], key)
    assert runs["shard"]["ckpt_path"] == runs["ddp"]["ckpt_path"]
    assert_same(runs["shard"]["state"], runs["ddp"]["state"], "after fit")
    return {"ckpt_path": runs["shard"]["ckpt_path"]}


@scenario
def strategy_collectives(rank: int, world: int, root: Path) -> dict:
    """``barrier``, ``broadcast``, ``reduce``, ``all_gather`` and ``reduce_boolean_decision`` of the strategy, as
    DDPStrategy answers them (Lightning's strategy tests call them directly on the trainer's strategy)."""
    answers = {}
    for name in ("ddp", "shard"):
        t = trainer("ddp" if name == "ddp" else shard(), root / name, max_steps=1, barebones=True)
        t.fit(BoringNet(), loader(1))
        s = t.strategy
        s.barrier("named")
        x = torch.tensor([1.0 + rank, 10.0 * rank])
        answers[name] = {
            "broadcast_obj": s.broadcast({"rank": rank, "t": torch.tensor([rank])}, src=1),
            "broadcast_tensor": s.broadcast(torch.tensor([float(rank)]), src=0),
            **{f"reduce_{op}": s.reduce(x.clone(), reduce_op=op) for op in ("mean", "sum", "max", "min", "avg")},
            "reduce_default": s.reduce(x.clone()),
            "reduce_other": s.reduce(3.5),
            "all_gather": s.all_gather(x.clone()),
            "decision_all": s.reduce_boolean_decision(rank == 0, all=True),
            "decision_any": s.reduce_boolean_decision(rank == 0, all=False),
        }
    assert answers["shard"].keys() == answers["ddp"].keys()
    for key, value in answers["ddp"].items():
        ours = answers["shard"][key]
        if isinstance(value, dict):
            assert ours["rank"] == value["rank"] and torch.equal(ours["t"], value["t"]), key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(ours, value), (key, ours, value)
        else:
            assert ours == value, (key, ours, value)
    return {}


class LoggingNet(BoringNet):
    """``self.log`` with ``sync_dist`` and each ``reduce_fx``, on step and on epoch, ``log_dict``, and a loss made
    from ``self.all_gather(..., sync_grads=True)`` (a contrastive loss over the global batch: Lightning's
    ``test_all_gather_sync_grads``), whose gradient flows back through the other ranks' samples."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        everyone = self.all_gather(logits, sync_grads=True).reshape(-1, 2)
        loss = F.cross_entropy(logits, y) + 0.1 * everyone.pow(2).mean()
        for fx in ("mean", "sum", "max", "min"):
            self.log(f"loss_{fx}", loss, sync_dist=True, reduce_fx=fx, on_step=True, on_epoch=True)
        self.log_dict({"rank_sum": torch.tensor(float(self.global_rank + 1))}, sync_dist=True, reduce_fx="sum")
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss


@scenario
def sync_dist_logging(rank: int, world: int, root: Path) -> dict:
    runs = {}
    for name in ("ddp", "shard"):
        torch.manual_seed(0)
        model = LoggingNet()
        t = trainer("ddp" if name == "ddp" else shard(), root / name, max_epochs=2, log_every_n_steps=1)
        t.fit(model, loader(1))
        runs[name] = (dict(t.callback_metrics), model.losses, state_of(t))
    assert_metrics(runs["shard"][0], runs["ddp"][0], "callback_metrics")
    torch.testing.assert_close(torch.tensor(runs["shard"][1]), torch.tensor(runs["ddp"][1]), rtol=1e-5, atol=1e-6)
    assert_same(runs["shard"][2], runs["ddp"][2], "all_gather(sync_grads=True)")
    return {"metrics": sorted(runs["shard"][0])}


class SanityNet(BoringNet):
    def __init__(self) -> None:
        super().__init__()
        self.val_losses: list[float] = []

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.val_losses.append(self.all_gather(loss).mean().item())
        self.log("val_loss", loss, sync_dist=True)


@scenario
def sanity_val_steps(rank: int, world: int, root: Path) -> dict:
    """``num_sanity_val_steps`` (2, and -1: the whole validation set) before any training step, with and without
    ``keep_gathered_in_eval``: the same validation numbers as ddp, and training after it unchanged."""
    out = {}
    for steps in (2, -1):
        runs = {}
        for name in ("ddp", "shard", "shard_held"):
            torch.manual_seed(0)
            model = SanityNet()
            strategy = "ddp" if name == "ddp" else shard(keep_gathered_in_eval=name == "shard_held")
            t = trainer(strategy, root / f"{name}{steps}", num_sanity_val_steps=steps)
            t.fit(model, loader(1), loader(2))
            runs[name] = (model.val_losses, model.losses, state_of(t))
        for name in ("shard", "shard_held"):
            for i in (0, 1):
                torch.testing.assert_close(torch.tensor(runs[name][i]), torch.tensor(runs["ddp"][i]), rtol=1e-5,
                                           atol=1e-6)
            assert_same(runs[name][2], runs["ddp"][2], f"{name}, num_sanity_val_steps={steps}")
        out[steps] = len(runs["ddp"][0])
    return out


class BatchNormNet(BoringNet):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))


@scenario
def sync_batchnorm(rank: int, world: int, root: Path) -> dict:
    """test_fsdp.py ``test_strategy_sync_batchnorm`` (``sync_batchnorm=True``, every stage) needs GPUs: torch's
    SyncBatchNorm runs on CUDA devices only. On the CPU both strategies say so (ddp at setup, ShardStrategy at the
    first forward, in torch's words)."""
    errors = {}
    for name in ("ddp", "shard"):
        model = BatchNormNet()
        t = trainer("ddp" if name == "ddp" else shard(), root / name, sync_batchnorm=True)
        try:
            t.fit(model, loader(1))
        except ValueError as err:
            errors[name] = str(err)
    assert all("SyncBatchNorm" in error for error in errors.values()) and len(errors) == 2, errors
    return errors
