"""Sharded checkpoints inside a gloo world (see world.py): save on N ranks under one unit policy, load on M
ranks under another, and compare the full model and optimizer state with what was saved."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_shard.engine.shard_module import shard_module
from lightning_shard.checkpoint import sharded
from lightning_shard.checkpoint.io import open_checkpoint, save_sharded
from lightning_shard.checkpoint.full import full_optimizer_state_dict, full_state_dict
from tests import models
from tests.engine_scenarios import param_groups
from tests.world import as_lightning_rank

MODELS = {"gpt": models.TinyGPT, "odd": models.Odd}


def _steps(model, runtime, opt, model_cls, batches, rank, world):
    losses = []
    for batch in batches:
        loss = model_cls.loss(model, batch.chunk(world)[rank], 0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses


def _batches(model_cls, seed, n):
    g = torch.Generator().manual_seed(seed)
    return [model_cls.batch(g, 12) for _ in range(n)]


def _build(name, seed, policy):
    model_cls = MODELS[name]
    torch.manual_seed(seed)
    model = model_cls()
    runtime = shard_module(model, **policy)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    return model_cls, model, runtime, opt


def save_then_continue(rank, world, name, policy, path):
    """Train 3 steps, save, train 2 more; return the saved full state and the 2 losses after the save."""
    model_cls, model, runtime, opt = _build(name, 0, policy)
    _steps(model, runtime, opt, model_cls, _batches(model_cls, 1, 3), rank, world)
    checkpoint = {"state_dict": sharded.model_state(runtime),
                  "optimizer_states": [sharded.optimizer_state(runtime, opt)], "epoch": 7}
    save_sharded(checkpoint, Path(path))
    saved = (full_state_dict(runtime, rank0_only=False), full_optimizer_state_dict(runtime, opt, rank0_only=False))
    after = _steps(model, runtime, opt, model_cls, _batches(model_cls, 2, 2), rank, world)
    return {"model": saved[0], "optimizer": saved[1], "after": after, "units": len(runtime.units)}


def load_then_continue(rank, world, name, policy, path):
    """A differently seeded model under another policy: load, report the full state, train 2 steps."""
    model_cls, model, runtime, opt = _build(name, 99, policy)
    checkpoint = open_checkpoint(Path(path))
    source = checkpoint["state_dict"]
    sharded.load_model_state(runtime, source.directory, source.metadata)
    sharded.load_optimizer_state(runtime, opt, 0, checkpoint["optimizer_states"][0], source.directory, source.metadata)
    loaded = (full_state_dict(runtime, rank0_only=False), full_optimizer_state_dict(runtime, opt, rank0_only=False))
    after = _steps(model, runtime, opt, model_cls, _batches(model_cls, 2, 2), rank, world)
    return {"model": loaded[0], "optimizer": loaded[1], "after": after, "epoch": checkpoint["epoch"],
            "units": len(runtime.units)}


def load_expecting_error(rank, world, name, policy, path):
    model_cls, model, runtime, opt = _build(name, 99, policy)
    try:
        checkpoint = open_checkpoint(Path(path))
        source = checkpoint["state_dict"]
        sharded.load_model_state(runtime, source.directory, source.metadata)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return f"{type(err).__name__}: {err}"
    return None


def save_twice_rank1_dies_in_the_second(rank, world, path):
    """A complete save, one more step, then a save during which rank 1 is killed half-way through its file."""
    model_cls, model, runtime, opt = _build("gpt", 0, {"units": ["Block"]})
    _steps(model, runtime, opt, model_cls, _batches(model_cls, 1, 2), rank, world)
    save_sharded({"state_dict": sharded.model_state(runtime), "optimizer_states": []}, Path(path))
    first = full_state_dict(runtime, rank0_only=False)
    _steps(model, runtime, opt, model_cls, _batches(model_cls, 2, 1), rank, world)
    if rank == 1:
        def dying_save(items, directory):
            with open(Path(directory) / "__1_0.distcp", "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        sharded.save = dying_save
    try:
        save_sharded({"state_dict": sharded.model_state(runtime), "optimizer_states": []}, Path(path))
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return {"first": first, "error": f"{type(err).__name__}: {err}"}
    return {"first": first, "error": None}


def load_model_only(rank, world, path):
    model_cls, model, runtime, opt = _build("gpt", 99, {"unit_size": 700})
    source = open_checkpoint(Path(path))["state_dict"]
    sharded.load_model_state(runtime, source.directory, source.metadata)
    return full_state_dict(runtime, rank0_only=False)


def load_pretrained_file(rank, world, path, policy):
    """A differently seeded model, sharded, then loaded from a full weights file."""
    from lightning_shard.checkpoint.pretrained import load_pretrained

    model_cls, model, runtime, opt = _build("gpt", 99, policy)
    result = load_pretrained(model, path)
    return {"model": full_state_dict(runtime, rank0_only=False), "result": result}


def resumes_that_cannot_restore_the_optimizers(rank, world, directory):
    """A weights-only checkpoint (``ModelCheckpoint(save_weights_only=True)``) and one saved with another number of
    optimizers, resumed: Lightning's own error for the first, ours for the second; what each said."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)

    class Module(L.LightningModule):
        def __init__(self, optimizers: int = 1) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
            self.optimizer_count = optimizers
            self.automatic_optimization = optimizers == 1

        def training_step(self, batch, _):
            loss = self.net(batch).pow(2).mean()
            if not self.automatic_optimization:
                self.manual_backward(loss)
                for optimizer in self.optimizers():
                    optimizer.step()
                    optimizer.zero_grad()
            return loss

        def configure_optimizers(self):
            layers = [self.net] if self.optimizer_count == 1 else list(self.net)
            return [torch.optim.AdamW(layer.parameters(), lr=1e-3) for layer in layers]

    def fit(weights_only: bool, optimizers: int = 1, ckpt_path=None, steps: int = 2):
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ShardStrategy(units=["Linear"]),
                            max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1,
                                                       save_weights_only=weights_only)])
        data = torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=2)
        try:
            trainer.fit(Module(optimizers), data, ckpt_path=ckpt_path)
        except (KeyError, RuntimeError) as err:
            return f"{type(err).__name__}: {err}"
        return "resumed"

    from lightning_shard.checkpoint.consolidate import consolidate

    fit(weights_only=True)
    meta = torch.load(Path(directory) / "last.ckpt" / "meta.pt", weights_only=True)
    consolidated = consolidate(Path(directory) / "last.ckpt")
    weights_only = fit(weights_only=True, ckpt_path="last", steps=4)
    fit(weights_only=False, steps=2)
    other_count = fit(weights_only=False, optimizers=2, ckpt_path="last", steps=4)
    return {"meta_keys": sorted(meta), "consolidated_keys": sorted(consolidated), "weights_only": weights_only,
            "other_count": other_count}
