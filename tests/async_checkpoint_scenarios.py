"""Scenarios for test_checkpoint_async.py, run inside a gloo world: ``ShardStrategy(async_save=True)`` through the
Trainer against the synchronous save and DDP, and its failures (a write error, a rank killed while it writes).

The background writes are held, delayed, failed or killed by patching ``StagedWriter.write_data`` in the ranks'
processes (each world's ranks are fresh processes). A held write waits until the next optimizer step has run (or until
the training thread waits for it): what it writes must be the state at its save, not the one the step made since.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard.checkpoint import async_save
from lightning_shard.checkpoint.full import full_state_dict
from tests.models import TinyGPT
from tests.world import as_lightning_rank

STEPS = 6  # one epoch on 2 ranks (48 samples, batches of 4 per rank)
SAMPLES = 48


def _lightning():
    import lightning as L

    class GPTModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            loss = TinyGPT.loss(self.model, tokens, batch_idx)
            self.losses.append(float(self.all_gather(loss.detach()).mean()))
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]

    class Writes(L.Callback):
        """Gives the held writes the trainer, whose ``global_step`` counts the optimizer steps."""

        def __init__(self) -> None:
            self.trainer: Any = None

        def on_train_start(self, trainer, *args: Any) -> None:
            self.trainer = trainer

        def on_train_end(self, trainer, *args: Any) -> None:  # (the staging memory is given back after this)
            background = trainer.strategy.checkpoints.background
            self.held_bytes = background.held_bytes if background is not None else 0

    return L, GPTModule, Writes


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(TinyGPT.batch(g, SAMPLES)), batch_size=4)


# -- what the patched writer does ------------------------------------------------------------------------------------
_writes = {"n": 0}
_waited_for = threading.Event()  # the training thread waits for the save in flight: a held write goes on


def patch_writes(mode: str, rank: int, at: int = 2, delay: float = 0.0, trainer_step=lambda: 0) -> list[list]:
    """``mode``: ``hold`` (until the next step has run), ``delay`` (sleep ``delay`` s), ``fail`` (rank 1's ``at``-th
    write raises, ``delay`` s into it), ``kill`` (rank 1 killed half-way through its ``at``-th write). Returns, for
    ``hold``, each save's record of the steps run before it was written."""
    original = async_save.StagedWriter.write_data
    original_complete, original_save = async_save.AsyncSaver.complete, async_save.AsyncSaver.save
    records: list[list] = []
    saved_at: list[int] = []  # the step of each save, in order

    def write_data(self, plan, planner):
        _writes["n"] += 1
        if mode == "hold":  # until an optimizer step has run since the save, or the training thread waits for it
            staged_at, deadline = saved_at.pop(0), time.monotonic() + 30
            while trainer_step() == staged_at and not _waited_for.is_set() and time.monotonic() < deadline:
                time.sleep(0.002)
            records.append([trainer_step() - staged_at])
        elif mode == "delay":
            time.sleep(delay)
        elif mode in ("fail", "kill") and rank == 1 and _writes["n"] == at:
            if mode == "fail":
                time.sleep(delay)
                raise OSError(28, "No space left on device (injected)")
            with open(Path(self.path) / "__1_0.distcp", "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)

    def complete(self, group=None):  # the training thread waits for it: nothing more can run meanwhile
        _waited_for.set()
        try:
            return original_complete(self, group)
        finally:
            _waited_for.clear()

    def save(self, *args, **kwargs):
        saved_at.append(trainer_step())
        return original_save(self, *args, **kwargs)

    async_save.StagedWriter.write_data = write_data
    async_save.AsyncSaver.complete = complete
    async_save.AsyncSaver.save = save
    return records


# -- exactness -------------------------------------------------------------------------------------------------------
def _fit(world: int, directory: str, strategy: Any, every: int = 2, resume: Optional[str] = None,
         callbacks: tuple = (), **checkpoint: Any) -> tuple[Any, Any]:
    L, GPTModule, Writes = _lightning()
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = GPTModule()
    checkpoint.setdefault("save_top_k", -1)
    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=every, **checkpoint)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[*callbacks, saves], deterministic=True)
    trainer.fit(module, _loader(), ckpt_path=resume)
    return module, trainer


def save_both_ways(rank: int, world: int, directory: str, options: dict) -> dict:
    """The same fit under DDP, under ShardStrategy saving synchronously and under ShardStrategy saving in the
    background (each write held until the next step has run), checkpoints every 2 steps."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    _, _, Writes = _lightning()
    ddp, _ = _fit(world, os.path.join(directory, "ddp"), "ddp")
    sync, _ = _fit(world, os.path.join(directory, "sync"), ShardStrategy(units=["Block"], **options))
    writes = Writes()
    held = patch_writes("hold", rank, trainer_step=lambda: writes.trainer.global_step if writes.trainer else 0)
    background, trainer = _fit(world, os.path.join(directory, "async"), ShardStrategy(units=["Block"], async_save=True,
                                                                                     **options), callbacks=(writes,))
    after_fit = {"held_bytes": trainer.strategy.checkpoints.background.held_bytes,
                 "threads": [t.name for t in threading.enumerate() if t.name.startswith("lightning_shard_checkpoint")]}
    # the same Trainer fits 2 steps more: saving in the background again (held from its first save to its end)
    trainer.fit_loop.epoch_loop.max_steps = STEPS + 2
    trainer.fit(background, _loader())
    again = os.path.join(directory, "async", f"epoch=1-step={STEPS + 2}.ckpt")
    return {"ddp": ddp.losses, "sync": sync.losses, "async": background.losses, "held": held,
            "staging": trainer.strategy.memory_estimate.checkpoint_staging, "held_bytes": writes.held_bytes,
            "after_fit": after_fit, "second_fit": (trainer.global_step, os.path.isfile(os.path.join(again, "manifest.json")),
                                                   writes.held_bytes)}


def resume(rank: int, world: int, path: str, options: dict, async_saves: bool) -> dict:
    """A fresh fit resumed from ``path`` to the end (saving on the way, in the background or not): its losses and its
    final full state."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    strategy = ShardStrategy(units=["Block"], async_save=async_saves, **options)
    module, trainer = _fit(world, os.path.join(os.path.dirname(path), f"resumed_on_{world}"), strategy, resume=path)
    return {"losses": module.losses, "state": full_state_dict(trainer.strategy.runtime, rank0_only=False),
            "step": trainer.global_step}


# -- failures --------------------------------------------------------------------------------------------------------
def fails_while_writing(rank: int, world: int, directory: str, mode: str, every: int = 1, at: int = 2,
                        pause: bool = False) -> dict:
    """Saves ``last.ckpt`` every ``every`` steps, in the background; rank 1's ``at``-th write fails (``fail``) or rank
    1 is killed in it (``kill``). What each surviving rank raised, and at which step. ``pause``: the step after each
    save begins 0.5 s late (the failure is there by the time it starts), else the failure comes 0.3 s into the write
    (after that step has begun)."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    L, _, Writes = _lightning()
    writes = Writes()
    patch_writes(mode, rank, at=at, delay=0.0 if pause else 0.3,
                 trainer_step=lambda: writes.trainer.global_step if writes.trainer else 0)
    trainer_box: list = []

    class Where(L.Callback):
        def on_train_batch_start(self, trainer, *args: Any) -> None:
            if pause and trainer.global_step and trainer.global_step % every == 0:
                time.sleep(0.5)

        def on_exception(self, trainer, pl_module, exception) -> None:
            trainer_box.append(trainer.global_step)

    strategy = ShardStrategy(units=["Block"], async_save=True, timeout=20)
    try:
        _fit(world, directory, strategy, every=every, save_last=True, save_top_k=0, callbacks=(Where(),))
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        return {"error": "".join(traceback.format_exception(err)), "type": type(err).__name__,
                "message": str(err), "step": trainer_box[0] if trainer_box else None}
    return {"error": None, "step": None}


def rank0_killed_while_the_next_save_waits(rank: int, world: int, directory: str) -> dict:
    """Saves ``last.ckpt`` every step; rank 0 (the one that commits) is killed in its second write once both ranks'
    training threads wait for it (the third save): what rank 1 raised."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    original, original_complete = async_save.StagedWriter.write_data, async_save.AsyncSaver.complete
    waiting, writes = threading.Event(), {"n": 0}

    def write_data(self, plan, planner):
        writes["n"] += 1
        if rank == 0 and writes["n"] == 2:
            waiting.wait(30)
            time.sleep(0.3)  # (rank 1 waits too: the ranks call complete together)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)

    def complete(self, group=None):
        waiting.set()
        return original_complete(self, group)

    async_save.StagedWriter.write_data = write_data
    async_save.AsyncSaver.complete = complete
    try:
        _fit(world, directory, ShardStrategy(units=["Block"], async_save=True, timeout=20), every=1, save_last=True,
             save_top_k=0)
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        return {"error": "".join(traceback.format_exception(err))}
    return {"error": None}


def quick_saves_and_the_last_step(rank: int, world: int, directory: str) -> dict:
    """Two saves in quick succession at step 2 (``trainer.save_checkpoint`` twice), every write slowed down; a
    ``ModelCheckpoint`` saving at the last step, rotating its top 1 (by step); whether each is complete when ``fit``
    returns, and whether a complete checkpoint was there whenever a save had just returned."""
    from lightning_shard import ShardStrategy
    from lightning_shard.checkpoint import files

    as_lightning_rank(rank, world)
    L, _, _ = _lightning()
    patch_writes("delay", rank, delay=0.5)
    complete_at_each_save: list[bool] = []

    class TwoSaves(L.Callback):
        def on_train_batch_end(self, trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                trainer.save_checkpoint(os.path.join(directory, "first.ckpt"))
                trainer.save_checkpoint(os.path.join(directory, "second.ckpt"))

    class AtFitEnd(L.Callback):  # Lightning calls it after the strategy's teardown: saved before fit returns
        def on_fit_end(self, trainer, *args: Any) -> None:
            trainer.save_checkpoint(os.path.join(directory, "at_fit_end.ckpt"))

    class Complete(L.Callback):  # right after the last step's saves (and the removal of the one each replaces)
        def on_train_batch_start(self, trainer, *args: Any) -> None:
            if trainer.global_step > 0:
                rotated = [p for p in Path(directory).glob("epoch=*.ckpt") if (p / files.MANIFEST).is_file()]
                complete_at_each_save.append(bool(rotated))

    strategy = ShardStrategy(units=["Block"], async_save=True)
    _fit(world, directory, strategy, every=1, callbacks=(TwoSaves(), Complete(), AtFitEnd()), monitor="step",
         mode="max", save_top_k=1)
    done = {name: (Path(directory) / name / files.MANIFEST).is_file()
            for name in ("first.ckpt", "second.ckpt", f"epoch=0-step={STEPS}.ckpt", "at_fit_end.ckpt")}
    dist.barrier()
    return {"done": done, "complete_at_each_save": complete_at_each_save,
            "rotated": sorted(p.name for p in Path(directory).glob("epoch=*"))}


def names_and_links(rank: int, world: int, directory: str) -> dict:
    """``ModelCheckpoint`` decides from what is on disk, where a save in flight is not yet. Two fits, every write 0.3 s
    slower: one reusing a file name (the version counter: ``fixed.ckpt``, ``fixed-v1.ckpt``...) with
    ``save_last="link"``; one linking ``last`` while rank 1's third write fails (``last`` must stay on the second)."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    original, writes = async_save.StagedWriter.write_data, {"n": 0, "fail_at": None}

    def write_data(self, plan, planner):
        writes["n"] += 1
        time.sleep(0.3)
        if rank == 1 and writes["n"] == writes["fail_at"]:
            raise OSError(28, "No space left on device (injected)")
        return original(self, plan, planner)

    async_save.StagedWriter.write_data = write_data
    out: dict[str, Any] = {}
    names = os.path.join(directory, "names")
    _fit(world, names, ShardStrategy(units=["Block"], async_save=True), every=1, filename="fixed", monitor="step",
         mode="max", save_last="link")
    out["names"] = sorted(p.name for p in Path(names).iterdir())
    out["names_last"] = os.readlink(os.path.join(names, "last.ckpt"))
    writes.update(n=0, fail_at=3)
    links = os.path.join(directory, "links")
    try:
        _fit(world, links, ShardStrategy(units=["Block"], async_save=True, timeout=20), every=1, save_top_k=1,
             monitor="step", mode="max", save_last="link")
    except OSError as err:
        out["error"] = str(err)
    out["links_last"] = os.readlink(os.path.join(links, "last.ckpt"))
    return out


def complete_saves_equal(rank: int, world: int, directory: str) -> dict:
    """Consolidated, the checkpoints ``first.ckpt`` and ``second.ckpt`` (rank 0)."""
    from lightning_shard.checkpoint.consolidate import consolidate

    if rank:
        return {}
    return {name: consolidate(Path(directory) / name) for name in ("first.ckpt", "second.ckpt")}


# -- units of several dtypes, 4-bit bases, checkpoints without the frozen base ----------------------------------------
def _lora_fit(rank: int, world: int, base: str, directory: str, strategy: Any, resume: Optional[str] = None,
              callbacks: tuple = ()) -> tuple[Any, Any]:
    """The mixed-dtype LoRA fit of mixed_scenarios (a bf16 base, fp32 adapters), checkpointing every 2 steps."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.mixed_scenarios import GLOBAL_BATCH, STEPS as LORA_STEPS, _lora_module, batches

    L, LoraModule = _lora_module()
    size = GLOBAL_BATCH // world
    module = LoraModule(base, slice(rank * size, (rank + 1) * size))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=LORA_STEPS, logger=False,
                        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[*callbacks, ModelCheckpoint(dirpath=directory, every_n_train_steps=2,
                                                               save_top_k=-1)])
    trainer.fit(module, DataLoader(batches(), batch_size=None), ckpt_path=resume)
    return module, trainer


def lora_both_ways(rank: int, world: int, base: str, directory: str) -> dict:
    """Mixed-dtype units under ``save_frozen=False`` (the adapters saved, the frozen bf16 base left out), saved
    synchronously and in the background (writes held until the next step has run)."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    _, _, Writes = _lightning()
    sync, _ = _lora_fit(rank, world, base, os.path.join(directory, "sync"),
                        ShardStrategy(units=["LlamaDecoderLayer"], save_frozen=False))
    writes = Writes()
    held = patch_writes("hold", rank, trainer_step=lambda: writes.trainer.global_step if writes.trainer else 0)
    background, trainer = _lora_fit(rank, world, base, os.path.join(directory, "async"),
                                    ShardStrategy(units=["LlamaDecoderLayer"], save_frozen=False, async_save=True),
                                    callbacks=(writes,))
    return {"sync": sync.losses, "async": background.losses, "held": held}


def lora_resume(rank: int, world: int, base: str, path: str, async_saves: bool) -> dict:
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    strategy = ShardStrategy(units=["LlamaDecoderLayer"], save_frozen=False, async_save=async_saves)
    module, trainer = _lora_fit(rank, world, base, os.path.join(os.path.dirname(path), f"resumed_on_{world}"),
                                strategy, resume=path)
    return {"losses": module.losses, "state": full_state_dict(trainer.strategy.runtime, rank0_only=False)}


def qlora_both_ways(rank: int, world: int, base: str, case: tuple, directory: str) -> dict:
    """QLoRA's 4-bit bases (the engine alone, as tests/qlora_scenarios.py): 3 steps, a synchronous save, a save in the
    background whose write is held until a 4th step has run."""
    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.io import save_sharded
    from tests.qlora_scenarios import _sharded_qlora, _sharded_steps
    from tests.mixed_scenarios import batches

    model, runtime, optimizer = _sharded_qlora(base, case, seed=0)
    _sharded_steps(model, runtime, optimizer, batches()[:3], rank, world)

    def checkpoint() -> dict:
        return {"state_dict": sharded.model_state(runtime),
                "optimizer_states": [sharded.optimizer_state(runtime, optimizer)]}

    save_sharded(checkpoint(), Path(directory) / "sync")
    saver = async_save.AsyncSaver()
    saver.setup()
    runtime.reducer.background = saver
    steps = [0]
    held = patch_writes("hold", rank, trainer_step=lambda: steps[0])
    saver.save(checkpoint(), Path(directory) / "async")
    _sharded_steps(model, runtime, optimizer, batches()[3:4], rank, world)
    steps[0] = 1
    saver.complete()
    return {"held": held, "held_bytes": saver.held_bytes}


def qlora_resume(rank: int, world: int, base: str, case: tuple, path: str) -> dict:
    """Another start resumed from ``path`` on this world, 2 more steps: the full state loaded and after."""
    from tests.qlora_scenarios import resumed_qlora

    loaded, resumed = resumed_qlora(rank, world, base, case, path)
    return {"loaded": loaded, "resumed": resumed}


def engine_both_ways(rank: int, world: int, device_type: str, directory: str, offload: Optional[str] = None,
                     sharding: Optional[dict] = None) -> dict:
    """The engine alone on ``device_type`` (every rank on device 0 of a GPU): a synchronous save and a save in the
    background, whose device copies are queued on the stream and whose write is held until 2 more steps have run;
    the host memory kept (the copies of every tensor saved) and whether it was pinned. ``sharding``: shard_module's
    (``{"sharding": "hybrid", "shard_size": 2}``: replicas offer the same blocks, DCP writes each once)."""
    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.io import save_sharded, split_checkpoint
    from lightning_shard.checkpoint.staging import leaves as staged_leaves
    from lightning_shard.engine.shard_module import shard_module
    from tests.checkpoint_scenarios import _batches, _steps
    from tests.engine_scenarios import param_groups

    from tests.test_cuda import device_or_refusal

    device, refused = device_or_refusal(device_type)
    if refused:
        return {"refused": refused}
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    runtime = shard_module(model, units=["Block"], device=device, offload=offload, **(sharding or {}))
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    runtime.attach_optimizer(optimizer)
    on_device = lambda batches: [b.to(device) for b in batches]  # noqa: E731
    _steps(model, runtime, optimizer, TinyGPT, on_device(_batches(TinyGPT, 1, 3)), rank, world)

    def checkpoint() -> dict:
        return {"state_dict": sharded.model_state(runtime),
                "optimizer_states": [sharded.optimizer_state(runtime, optimizer)], "epoch": 3}

    save_sharded(checkpoint(), Path(directory) / "sync")
    saver = async_save.AsyncSaver(device=device)
    saver.setup()
    runtime.reducer.background = saver
    steps = [0]
    held = patch_writes("hold", rank, trainer_step=lambda: steps[0])
    saver.save(checkpoint(), Path(directory) / "async")
    leaves = list(staged_leaves(split_checkpoint(checkpoint())))  # (as the save flattens it)
    _steps(model, runtime, optimizer, TinyGPT, on_device(_batches(TinyGPT, 2, 2)), rank, world)
    steps[0] = 2
    saver.complete()
    pinned = all(b.is_pinned() for b in saver.stager._buffers)
    return {"held": held, "held_bytes": saver.held_bytes, "bytes": sum(t.numel() * t.element_size() for t in leaves),
            "pinned": pinned, "devices": sorted({str(t.device) for t in leaves})}
