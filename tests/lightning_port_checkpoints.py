"""Ported scenarios: checkpoints of every kind, saved and resumed under ShardStrategy and ddp (test_fsdp.py,
test_model_parallel_integration.py, test_custom_strategy.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shard import ShardStrategy
from tests.lightning_port_models import (
    UNITS, BoringNet, assert_metrics, assert_same, broadcast_path, loader, scenario, shard, state_of, trainer,
)


def _multiple_stages(rank: int, world: int, root: Path, state_dict_type: str) -> dict:
    """test_fsdp.py ``test_strategy_checkpoint`` / ``test_checkpoint_multi_gpus`` (``_run_multiple_stages``): fit,
    test, a checkpoint after testing and a weights-only one over ``last.ckpt``, then under ``torch.inference_mode()``
    test and predict with the fitted model and from the checkpoint; then fit on. Each number as ddp's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    runs = {}
    for name in ("ddp", "shard"):
        strategy = (lambda: "ddp") if name == "ddp" else (lambda: shard(state_dict_type=state_dict_type))
        torch.manual_seed(0)
        model = BoringNet()
        directory = root / name
        t = trainer(strategy(), directory, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)])
        t.fit(model, loader(1), loader(2))
        out = {"fit_test": t.test(model, loader(3), verbose=False)}
        path = broadcast_path(Path(t.checkpoint_callback.last_model_path))
        t.save_checkpoint(path.with_name("after-test.ckpt"))
        t.save_checkpoint(path, weights_only=True)
        if name == "shard" and state_dict_type == "full":  # _assert_save_equality
            state = t.strategy.lightning_module_state_dict()
            if rank == 0:
                assert_same(BoringNet.load_from_checkpoint(path).state_dict(), state, "load_from_checkpoint", 0, 0)
            else:
                assert state == {}
        with torch.inference_mode():
            out["test"] = t.test(model, loader(3), verbose=False)
            out["test_ckpt"] = t.test(ckpt_path=path, dataloaders=loader(3), verbose=False, weights_only=True)
            out["predict"] = torch.cat(t.predict(model, loader(3)))
            out["predict_ckpt"] = torch.cat(t.predict(ckpt_path=path, dataloaders=loader(3)))
        t2 = trainer(strategy(), directory, max_epochs=2)  # training goes on after inference_mode
        t2.fit(model, loader(1), ckpt_path=path.with_name("after-test.ckpt"))
        out["losses"], out["state"] = model.losses, state_of(t2)
        runs[name] = out
    for key in ("fit_test", "test", "test_ckpt"):
        assert_metrics(runs["shard"][key], runs["ddp"][key], key)
    for key in ("predict", "predict_ckpt"):
        torch.testing.assert_close(runs["shard"][key], runs["ddp"][key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(runs["shard"]["losses"]), torch.tensor(runs["ddp"]["losses"]),
                               rtol=1e-5, atol=1e-6)
    assert_same(runs["shard"]["state"], runs["ddp"]["state"], "after fitting on")
    return {"steps": len(runs["ddp"]["losses"])}


@scenario
def multiple_stages_sharded(rank: int, world: int, root: Path) -> dict:
    return _multiple_stages(rank, world, root, "sharded")


@scenario
def multiple_stages_full(rank: int, world: int, root: Path) -> dict:
    return _multiple_stages(rank, world, root, "full")


@scenario
def module_state_dict_keys(rank: int, world: int, root: Path) -> dict:
    """test_fsdp.py ``test_strategy_full_state_dict`` and test_model_parallel_integration.py
    ``test_strategy_state_dict``: ``lightning_module_state_dict()`` has the unsharded module's keys in its order;
    full: rank 0 only (empty elsewhere); sharded: every rank."""
    torch.manual_seed(0)
    model = BoringNet()
    model.register_buffer("steps_seen", torch.zeros(3))
    expected = list(model.state_dict())
    keys = {}
    for kind in ("full", "sharded"):
        t = trainer(shard(state_dict_type=kind), root / kind, max_steps=2, barebones=True)
        t.fit(model, loader(1))
        keys[kind] = list(t.strategy.lightning_module_state_dict())
    assert keys["sharded"] == expected, keys["sharded"]
    assert keys["full"] == (expected if rank == 0 else []), keys["full"]
    return keys


@scenario
def save_full_resume_under_ddp(rank: int, world: int, root: Path) -> dict:
    """test_fsdp.py ``test_strategy_save_optimizer_states`` and ``test_load_full_state_checkpoint_into_regular_model``:
    a full checkpoint of ShardStrategy resumed by ddp restores the model and optimizer states bit for bit."""
    torch.manual_seed(0)
    model = BoringNet()
    t = trainer(shard(state_dict_type="full"), root)
    t.fit(model, loader(1))
    path = broadcast_path(root / "last.ckpt")
    t.save_checkpoint(path)
    model_state = t.strategy.lightning_module_state_dict()
    optimizer_state = t.strategy.optimizer_state(model.optimizers())
    if rank != 0:
        assert len(model_state) == 0 and len(optimizer_state) == 0
    restored = BoringNet()
    t = trainer("ddp", root)
    t.fit(restored, loader(1), ckpt_path=path)
    if rank == 0:
        torch.testing.assert_close(model_state, t.strategy.lightning_module_state_dict(), atol=0, rtol=0)
        torch.testing.assert_close(optimizer_state, t.strategy.optimizer_state(restored.optimizers()), atol=0, rtol=0)
    return {}


@scenario
def ddp_checkpoint_resumed_sharded(rank: int, world: int, root: Path) -> dict:
    """test_fsdp.py ``test_strategy_load_optimizer_states`` and ``test_load_standard_checkpoint_into_distributed_model``:
    ddp's checkpoint resumed by ShardStrategy: the model and optimizer states as ddp saved them, bit for bit."""
    torch.manual_seed(0)
    model = BoringNet()
    t = trainer("ddp", root)
    t.fit(model, loader(1))
    path = broadcast_path(root / "last.ckpt")
    t.save_checkpoint(path)
    model_state = t.strategy.lightning_module_state_dict()
    optimizer_state = t.strategy.optimizer_state(model.optimizers())
    restored = BoringNet()
    t = trainer(shard(state_dict_type="full"), root)
    t.fit(restored, loader(1), ckpt_path=path)
    restored_model = t.strategy.lightning_module_state_dict()
    restored_optimizer = t.strategy.optimizer_state(restored.optimizers())
    if rank == 0:
        torch.testing.assert_close(restored_model, model_state, atol=0, rtol=0)
        torch.testing.assert_close(restored_optimizer, optimizer_state, atol=0, rtol=0)
    else:
        assert len(restored_model) == 0 and len(restored_optimizer) == 0
    return {}


def _tensors_in(tree: Any) -> list[str]:
    if isinstance(tree, torch.Tensor):
        return [f"{tuple(tree.shape)}"]
    if isinstance(tree, dict):
        return [f"{k}.{t}" for k, v in tree.items() for t in _tensors_in(v)]
    if isinstance(tree, (list, tuple)):
        return [f"{i}.{t}" for i, v in enumerate(tree) for t in _tensors_in(v)]
    return []


class CheckpointNet(BoringNet):
    """test_fsdp.py ``TestFSDPCheckpointModel``: the parameters at ``on_train_start`` of a resumed fit."""

    def __init__(self, lr: float = 0.1, params_to_compare: Optional[dict] = None) -> None:
        super().__init__(lr)
        self.params_to_compare = params_to_compare

    def on_train_start(self):
        if self.params_to_compare is not None:
            assert_same(state_of(self.trainer), self.params_to_compare, "on_train_start", 0, 0)


@scenario
def sharded_checkpoint_resume(rank: int, world: int, root: Path) -> dict:
    """test_fsdp.py / test_model_parallel_integration.py ``test_save_load_sharded_state_dict``: the directory's files,
    ``meta.pt`` without tensors, and a resume (by path, and by ``ckpt_path="last"``) that starts from the saved
    parameters and goes on as ddp run uninterrupted for 2 epochs (the StepLR schedule and AdamW state restored)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    t = trainer(shard(), root, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=root, save_last=True)])
    t.fit(CheckpointNet(), loader(1))
    before = state_of(t)
    path = broadcast_path(Path(t.checkpoint_callback.best_model_path))
    files = sorted(p.name for p in path.iterdir())
    metadata = torch.load(path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata and len(metadata["callbacks"]) == 1, metadata.keys()
    # the tensors are in the .distcp files only (meta.pt keeps the optimizers' groups, named, beside them)
    assert "state_dict" not in metadata and not _tensors_in(metadata["optimizer_states"]), metadata.keys()
    torch.manual_seed(0)
    reference = CheckpointNet()
    trainer("ddp", root / "ddp", max_epochs=2).fit(reference, loader(1))
    for how in (path, "last"):
        resumed = CheckpointNet(params_to_compare=before)
        # "last": the last.ckpt of this callback's directory; by path: checkpoints elsewhere, keeping it
        t = trainer(shard(), root, max_epochs=2, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=root, save_last=True) if how == "last" else
                               ModelCheckpoint(dirpath=root / "again")])
        t.fit(resumed, loader(1), ckpt_path=how)
        torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(reference.losses[len(resumed.losses):]),
                                   rtol=1e-5, atol=1e-6)
        assert_same(state_of(t), {k: v for k, v in reference.state_dict().items()}, f"resumed from {how}")
        assert t.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"] == 8  # stepped per step
    return {"files": files}


@scenario
def consolidated_resumed_under_ddp(rank: int, world: int, root: Path) -> dict:
    """test_fsdp.py ``test_save_sharded_and_consolidate_and_load``: a sharded checkpoint consolidated into one file
    on rank 0 resumes under ddp, as ddp's own checkpoint of the same run does."""
    from lightning_shard.checkpoint.consolidate import consolidate

    torch.manual_seed(0)
    t = trainer(shard(), root, enable_checkpointing=True)
    t.fit(BoringNet(), loader(1))
    sharded = broadcast_path(Path(t.checkpoint_callback.best_model_path))
    full = broadcast_path(root / "checkpoint_full.ckpt")
    # rank 0 writes it; rank 1 consolidates too, without writing (consolidate() ran collectives on the default group
    # inside a job, issue 52: called on rank 0 alone it waited for rank 1)
    consolidate(sharded, full if rank == 0 else None)
    t.strategy.barrier()
    torch.manual_seed(0)
    t = trainer("ddp", root / "ddp", enable_checkpointing=True)
    t.fit(BoringNet(), loader(1))
    own = broadcast_path(Path(t.checkpoint_callback.best_model_path))
    runs = {}
    for name, path in (("consolidated", full), ("own", own)):
        model = BoringNet()
        t = trainer("ddp", root / name, max_epochs=2)
        t.fit(model, loader(1), ckpt_path=path)
        runs[name] = (model.losses, state_of(t))
    torch.testing.assert_close(torch.tensor(runs["consolidated"][0]), torch.tensor(runs["own"][0]), rtol=1e-5,
                               atol=1e-6)
    assert_same(runs["consolidated"][1], runs["own"][1], "resumed under ddp")
    return {"steps": len(runs["own"][0])}


class TwoOptimizerNet(BoringNet):
    """Manual optimization with two optimizers (a generator/discriminator split, ``toggle_optimizer``), each with a
    scheduler stepped per epoch, resumed from a checkpoint of either kind."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.critic = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        g_opt, d_opt = self.optimizers()
        self.toggle_optimizer(g_opt)
        fake = self(x)
        g_loss = F.cross_entropy(fake, y) - 0.1 * self.critic(fake).mean()
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        d_loss = self.critic(self(x).detach()).pow(2).mean() + (1 - self.critic(F.one_hot(y, 2).float())).pow(2).mean()
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.losses.append(self.all_gather(torch.stack([g_loss, d_loss]).detach()).mean(0).tolist())

    def on_train_epoch_end(self):
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self):
        g_opt = torch.optim.AdamW(self.layer.parameters(), lr=0.05)
        d_opt = torch.optim.SGD(self.critic.parameters(), lr=0.05, momentum=0.9)
        return [g_opt, d_opt], [torch.optim.lr_scheduler.StepLR(g_opt, 1, 0.5),
                                torch.optim.lr_scheduler.ExponentialLR(d_opt, 0.9)]


@scenario
def manual_two_optimizers_resume(rank: int, world: int, root: Path) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    reference = TwoOptimizerNet()
    t = trainer("ddp_find_unused_parameters_true", root / "ddp", max_epochs=3)
    t.fit(reference, loader(1))
    expected = state_of(t)
    for kind in ("sharded", "full"):
        torch.manual_seed(0)
        first = TwoOptimizerNet()
        t = trainer(shard(state_dict_type=kind), root / kind, max_epochs=1, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=root / kind, save_last=True)])
        t.fit(first, loader(1))
        resumed = TwoOptimizerNet()
        t = trainer(shard(state_dict_type=kind), root / kind, max_epochs=3, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=root / kind, save_last=True)])
        t.fit(resumed, loader(1), ckpt_path="last")
        torch.testing.assert_close(torch.tensor(first.losses + resumed.losses), torch.tensor(reference.losses),
                                   rtol=1e-5, atol=1e-6)
        assert_same(state_of(t), expected, f"two optimizers resumed from {kind}")
        lrs = [[g["lr"] for g in opt.param_groups] for opt in t.optimizers]
        assert lrs == [[g["lr"] for g in opt.param_groups] for opt in reference.trainer.optimizers], lrs
    return {}


class NoOptimizerRestore(ShardStrategy):
    """test_custom_strategy.py ``test_strategy_lightning_restore_optimizer_and_schedulers``."""

    load_optimizer_state_dict_called = False

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def load_optimizer_state_dict(self, checkpoint):
        self.load_optimizer_state_dict_called = True


@scenario
def restore_optimizer_flag(rank: int, world: int, root: Path) -> dict:
    torch.manual_seed(0)
    t = trainer(shard(), root, max_steps=2)
    t.fit(BoringNet(), loader(1))
    path = broadcast_path(root / "model.ckpt")
    t.save_checkpoint(path)
    strategy = NoOptimizerRestore(units=UNITS)
    t = trainer(strategy, root, max_steps=3)
    model = BoringNet()
    t.fit(model, loader(1), ckpt_path=path)
    assert not strategy.load_optimizer_state_dict_called
    return {}
