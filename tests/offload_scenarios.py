"""Scenarios for test_offload.py (issue 31), run inside a gloo world: Lightning fits with ``offload`` against the
same fit without it. On the CPU both step the same tensors with the same kernels, so they must agree bit for bit:
any difference is a host-path bug (a stale copy, a gradient lost or counted twice), not rounding."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard.checkpoint.full import full_state_dict
from tests.models import TinyGPT
from tests.world import as_lightning_rank

GLOBAL_BATCH = 12
STEPS_PER_EPOCH = 4


class InitGPT(TinyGPT):
    """TinyGPT that can be built on the meta device: the root's own parameter has an init."""

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.wpe, std=0.02)


class OffloadedGPT(L.LightningModule):
    """TinyGPT with AdamW (``optimizer="adamw"``) or Adafactor (a matrix optimizer: owner ranks step whole
    parameters on their CPU); built on the meta device with ``meta=True``; the loss of micro-batch ``nonfinite_at`` is inf."""

    def __init__(self, optimizer: str = "adamw", meta: bool = False, nonfinite_at: Optional[int] = None) -> None:
        super().__init__()
        self.optimizer, self.meta, self.nonfinite_at = optimizer, meta, nonfinite_at
        self.model = None if meta else TinyGPT()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = InitGPT()  # on the meta device under ShardStrategy: materialised unit by unit

    def training_step(self, batch, batch_idx):
        loss = TinyGPT.loss(self.model, batch, batch_idx)
        if self.current_epoch == 0 and batch_idx == self.nonfinite_at:  # a micro-batch: its whole step skipped
            loss = loss * math.inf
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def configure_optimizers(self):
        if self.optimizer == "adafactor":
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)
        # an implementation chosen: offload keeps it (it picks the fused CPU kernel only where none was chosen)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _batches(rank: int, world: int, epochs: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    per_rank = GLOBAL_BATCH // world
    return [TinyGPT.batch(g, GLOBAL_BATCH)[rank * per_rank:(rank + 1) * per_rank]
            for _ in range(STEPS_PER_EPOCH * epochs)]


def fit(rank: int, world: int, offload: Optional[str], epochs: int = 2, save_to: Optional[Path] = None,
        resume_from: Optional[Path] = None, state_dict_type: str = "sharded", **module_options):
    from lightning_shard import ShardStrategy

    torch.manual_seed(0)
    module = OffloadedGPT(**module_options)
    strategy = ShardStrategy(units=["Block"], offload=offload, nonfinite="skip", state_dict_type=state_dict_type)
    callbacks = [ModelCheckpoint(save_to, filename="{epoch}", save_top_k=-1)] if save_to is not None else []
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                        precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.05,
                        callbacks=callbacks, use_distributed_sampler=False, enable_checkpointing=save_to is not None,
                        enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.DataLoader(_batches(rank, world, 1), batch_size=None)
    trainer.fit(module, data, ckpt_path=str(resume_from) if resume_from is not None else None)
    return module, trainer


def _state(trainer) -> dict[str, torch.Tensor]:
    return full_state_dict(trainer.strategy.runtime, rank0_only=False)



def same_as_without(rank: int, world: int, optimizer: str) -> dict:
    """Per offload mode: whether its losses and weights equal (bitwise) the fit without offload, with bf16-mixed,
    accumulation, norm clipping and a skipped non-finite step; and where its state lives."""
    as_lightning_rank(rank, world)
    reference, ref_trainer = fit(rank, world, None, optimizer=optimizer, nonfinite_at=2)
    expected = _state(ref_trainer)
    report = {"skipped": ref_trainer.strategy.runtime.skipped_steps}
    for offload in ("optimizer", "params"):
        module, trainer = fit(rank, world, offload, optimizer=optimizer, nonfinite_at=2)
        state = _state(trainer)
        storages = [unit.storage for unit in trainer.strategy.runtime.units]
        report[offload] = {
            "losses": module.losses == reference.losses,
            "weights": [k for k in expected if not torch.equal(state[k], expected[k])],
            "offloaded": all(s.offloaded for s in storages),
            "skipped": trainer.strategy.runtime.skipped_steps,
            "kept_on_device": [s.host.keep_on_device for s in storages],
        }
    return report


def save(rank: int, world: int, offload: Optional[str], kind: str, save_dir: str) -> None:
    """One epoch, checkpointed after it."""
    as_lightning_rank(rank, world)
    fit(rank, world, offload, epochs=1, save_to=Path(save_dir) / f"{offload}-{kind}", state_dict_type=kind)


def resume(rank: int, world: int, cases: list[tuple[Optional[str], Optional[str], str]], save_dir: str) -> list:
    """Each case ``(offload when saved, offload now, checkpoint kind)``: resumed for a second epoch, against the
    plain run resumed from the plain run's checkpoint of that kind on this world; the differing parameters."""
    as_lightning_rank(rank, world)
    results = []
    for saved_with, offload, kind in cases:
        expected = _state(fit(rank, world, None, epochs=2, state_dict_type=kind,
                              resume_from=Path(save_dir) / f"None-{kind}" / "epoch=0.ckpt")[1])
        checkpoint = Path(save_dir) / f"{saved_with}-{kind}" / "epoch=0.ckpt"
        state = _state(fit(rank, world, offload, epochs=2, resume_from=checkpoint, state_dict_type=kind)[1])
        results.append([k for k in expected if not torch.equal(state[k], expected[k])])
    return results


def meta_init(rank: int, world: int) -> list[str]:
    """A model built on the meta device, materialised into host-memory shards: the parameters that differ from
    the same fit without offload."""
    as_lightning_rank(rank, world)
    _, reference = fit(rank, world, None, epochs=1, meta=True)
    _, trainer = fit(rank, world, "params", epochs=1, meta=True)
    expected, state = _state(reference), _state(trainer)
    return [k for k in expected if not torch.equal(state[k], expected[k])]


def fused_by_default(rank: int, world: int) -> dict:
    """AdamW with no implementation chosen steps with the fused CPU kernel when offloaded: its weights against the
    plain run with ``fused=True`` and with the default (for-loop), and the groups' options after the steps."""
    from lightning_shard.engine.shard_module import shard_module

    results = {}
    for name, offload, options in (("offloaded", "params", {}), ("fused", None, {"fused": True}),
                                   ("for-loop", None, {})):
        torch.manual_seed(0)
        model = TinyGPT()
        runtime = shard_module(model, units=["Block"], offload=offload)
        with runtime.shaped_parameters():
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **options)
        runtime.attach_optimizer(optimizer)
        for step, batch in enumerate(_batches(rank, world, 1)):
            TinyGPT.loss(model, batch, step).backward()
            runtime.step(optimizer)
            optimizer.zero_grad()
        results[name] = (full_state_dict(runtime, rank0_only=False), optimizer.param_groups[0]["fused"])
    offloaded, fused_option = results.pop("offloaded")
    return {"fused_option_after": fused_option,
            **{name: [k for k in state if not torch.equal(state[k], offloaded[k])] for name, (state, _) in results.items()}}


def _engine_fit(rank: int, world: int, offload: Optional[str], fused: bool, write_between: bool) -> tuple:
    """The engine alone: ``fused`` AdamW (its step leaves the version counters alone); with ``write_between``, after
    each step an evaluation forward (the staging copies are fresh then) and a weight write through ``.data``
    (WGAN's weight clipping, an EMA swap), which no version counter sees either."""
    from lightning_shard.engine.shard_module import shard_module

    torch.manual_seed(0)
    model = TinyGPT()
    runtime = shard_module(model, units=["Block"], offload=offload)
    with runtime.shaped_parameters():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    runtime.attach_optimizer(optimizer)
    losses = []
    for step, batch in enumerate(_batches(rank, world, 1)):
        loss = TinyGPT.loss(model, batch, step)
        loss.backward()
        runtime.step(optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
        # manual optimization's habit: a second forward in the same step, after the optimizer changed the shards
        losses.append(runtime.run_step(lambda: TinyGPT.loss(model, batch, step)).item())
        if write_between:
            with torch.no_grad():
                runtime.run_step(lambda: model(batch[:, :-1]))
            for param in model.parameters():
                param.data.clamp_(-0.05, 0.05)
    return losses, full_state_dict(runtime, rank0_only=False)


def written_between_steps(rank: int, world: int, fused: bool, write_between: bool) -> dict:
    """Per offload mode: the parameters that differ from the run without offload (none expected), and whether the
    losses are the same."""
    losses, expected = _engine_fit(rank, world, None, fused, write_between)
    report = {}
    for offload in ("optimizer", "params"):
        theirs, state = _engine_fit(rank, world, offload, fused, write_between)
        report[offload] = (theirs == losses, [k for k in expected if not torch.equal(state[k], expected[k])])
    return report
