"""Scenarios for test_host_step.py, run inside a gloo world: offload's optimizer step overlapped with backward
(engine/optim/host_step.py) against the same offloaded fit stepped after the backward (``offload_overlap=False``). Both run
the same kernels on the same tensors in the same order per element, so they must agree bit for bit; and the serial
one against the fit without offload, bit for bit too (test_offload.py's premise)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_shard.checkpoint.full import full_state_dict
from tests.models import Penalized, SlowAdamW, TinyGPT
from tests.offload_scenarios import _batches
from tests.world import as_lightning_rank


class FailingSGD(torch.optim.SGD):
    """SGD that fails at its third update of a parameter (a bug in the user's optimizer)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param]["updates"] = self.state[param].get("updates", 0) + 1
                    if self.state[param]["updates"] == 3:
                        raise ValueError("the user's optimizer failed")
        return super().step(closure)


class CountingSGD(torch.optim.SGD):
    """SGD whose learning rate decays with a step count it keeps outside its parameters' state: in each param group
    (timm's Adan) or, with ``where="state"``, in ``optimizer.state["k"]`` (MADGRAD's); ``where="gradients"``: plain SGD
    that adds weight decay to the gradients in place."""

    def __init__(self, params, where: str) -> None:
        super().__init__(params, lr=0.05)
        self.where = where

    @torch.no_grad()
    def step(self, closure=None):
        if self.where == "gradients":  # (no count: weight decay added to the gradients in place)
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.add_(param, alpha=0.01)
            return super().step(closure)
        if self.where == "state":
            self.state["k"] = self.state.get("k", 0) + 1
        for group in self.param_groups:
            if self.where == "group":
                group["step"] = group.get("step", 0) + 1
            count = self.state["k"] if self.where == "state" else group["step"]
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"] / count**0.5)


class GPT(L.LightningModule):
    """TinyGPT with AdamW (fused where none is chosen: the CPU's fused kernel when offloaded) or SGD with momentum;
    the loss of the micro-batches in ``nonfinite_at`` (epoch 0) is inf. ``in_step``: what the training step does
    before its loss's backward, as users write it there ("lr": a warmup that sets the learning rate; "clamp": a weight
    constraint through ``.data``; "norm": the parameters' norm, read before the forward, in ``norms``: this rank's
    shards, which hold the same values under offload as without, but without offload the step's root unit is gathered
    in their place)."""

    UNITS = ["Block"]
    ELEMENTWISE: tuple = ()  # optimizer classes of a subclass's, stepped elementwise

    def __init__(self, optimizer: str, nonfinite_at: tuple[int, ...] = (), in_step: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.optimizer, self.nonfinite_at, self.in_step = optimizer, nonfinite_at, in_step
        self.model = TinyGPT()
        self.losses: list[float] = []
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        if "lr" in self.in_step:
            for group in self.optimizers().param_groups:
                group["lr"] = 1e-2 * (1 + batch_idx % 3)
        if "clamp" in self.in_step:  # WGAN's weight clipping, before the critic's forward: no version counter sees it
            for param in self.parameters():
                param.data.clamp_(-0.05, 0.05)
        if "norm" in self.in_step:  # (this rank's shards: compared with the same rank's in the other fit)
            with torch.no_grad():
                self.norms.append(float(sum(p.double().square().sum() for p in self.parameters())))
        loss = TinyGPT.loss(self.model, batch, batch_idx)
        if self.current_epoch == 0 and batch_idx in self.nonfinite_at:
            loss = loss * math.inf
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def configure_optimizers(self):
        if self.optimizer.startswith("counting in "):
            return CountingSGD(self.parameters(), where=self.optimizer.split()[-1])
        if self.optimizer == "failing":
            return FailingSGD(self.parameters(), lr=0.05)
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        if self.optimizer == "slow adamw":
            return SlowAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        if self.optimizer == "slow adamw, a step post-hook reading its state":  # (the second moments' sum, in norms)
            optimizer = SlowAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
            optimizer.register_step_post_hook(lambda o, args, kwargs: self.norms.append(float(sum(
                o.state[p]["exp_avg_sq"].double().sum() for g in o.param_groups for p in g["params"] if o.state[p]))))
            return optimizer
        if self.optimizer == "slow adamw, a tensor lr decayed each step":  # the scheduler writes the lr in place
            optimizer = SlowAdamW(self.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1, fused=True)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                      lr=1e-2, fused=True)
        if self.optimizer == "adamw with a warmup hook":  # a step pre-hook setting the learning rate
            steps = []

            def warmup(optimizer, args, kwargs):
                steps.append(1)
                for group in optimizer.param_groups:
                    group["lr"] = 1e-2 * min(1.0, len(steps) / 3)

            optimizer.register_step_pre_hook(warmup)
        return optimizer


class Critic(GPT):
    """WGAN-GP's critic (tests/models.py ``Penalized``): its training step runs a ``create_graph=True`` backward of its
    own (the gradient penalty) before Lightning's backward of the loss."""

    UNITS = ["TanhBlock"]

    def __init__(self, optimizer: str, nonfinite_at: tuple[int, ...] = (), in_step: tuple[str, ...] = ()) -> None:
        super().__init__(optimizer, nonfinite_at, in_step)
        self.model = Penalized()

    def training_step(self, batch, batch_idx):
        loss = Penalized.loss(self.model, batch[:, :6].float() / 37, batch_idx)
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss


class ClipSchedule(Callback):
    """Sets ``Trainer.gradient_clip_val`` as each epoch starts (a clipping schedule)."""

    def __init__(self, by_epoch: tuple[Optional[float], ...]) -> None:
        self.by_epoch = by_epoch

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        trainer.gradient_clip_val = self.by_epoch[trainer.current_epoch]


def fit(rank: int, world: int, offload: Optional[str], overlap: bool, optimizer: str, clip: Optional[float],
        accumulate: int, epochs: int, nonfinite_at: tuple[int, ...] = (), save_to: Optional[Path] = None,
        resume_from: Optional[Path] = None, module: type = GPT, in_step: tuple[str, ...] = (),
        clip_by_epoch: Optional[tuple[Optional[float], ...]] = None, nonfinite: Optional[str] = "skip",
        ema: bool = False, free_grads_after_step: bool = True) -> dict:
    from lightning_shard import ShardedEMA, ShardStrategy

    torch.manual_seed(0)
    module = module(optimizer, nonfinite_at, in_step)
    strategy = ShardStrategy(units=module.UNITS, offload=offload, offload_overlap=overlap, nonfinite=nonfinite,
                             elementwise_optimizers=[FailingSGD, CountingSGD, SlowAdamW, *module.ELEMENTWISE],
                             free_grads_after_step=free_grads_after_step)
    callbacks = [ModelCheckpoint(save_to, filename="{epoch}", save_top_k=-1)] if save_to is not None else []
    callbacks += [ClipSchedule(clip_by_epoch)] if clip_by_epoch is not None else []
    callbacks += [ShardedEMA(decay=0.9)] if ema else []  # (its update reads the master shards after each step)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                        precision="bf16-mixed", accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                        callbacks=callbacks, use_distributed_sampler=False, enable_checkpointing=save_to is not None,
                        enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.DataLoader(_batches(rank, world, 2), batch_size=None)
    trainer.fit(module, data, ckpt_path=str(resume_from) if resume_from is not None else None)
    runtime = trainer.strategy.runtime
    stepper = runtime.host_stepper
    counts = {} if stepper is None else {
        "overlapped": stepper.overlapped_steps, "clipped": stepper.clipped_steps,
        "speculative": stepper.speculative_units, "redone": stepper.redone_units, "deferred": stepper.deferred.deferred_units}
    return {"losses": module.losses, "norms": module.norms, "state": full_state_dict(runtime, rank0_only=False),
            "skipped": runtime.skipped_steps, "restage": runtime.restage_each_step, **counts}


def _differ(a: dict, b: dict) -> list[str]:
    return [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]


def overlapped_as_serial(rank: int, world: int, cases: list[dict], save_dir: str) -> list[dict]:
    """Per case (fit options): the overlapped fit's counters, and what differs from the serial one and from the fit
    without offload (losses, parameters); with ``resume``, a second epoch resumed from each one's checkpoint."""
    as_lightning_rank(rank, world)
    reports = []
    for i, case in enumerate(cases):
        case = dict(case)
        resume = case.pop("resume", False)
        runs = {}
        for name, offload, overlap in (("overlapped", "optimizer", True), ("serial", "optimizer", False),
                                       ("plain", None, False), ("params", "params", True)):
            if resume:
                folder = Path(save_dir) / f"{i}-{name}"
                fit(rank, world, offload, overlap, epochs=1, save_to=folder, **case)
                runs[name] = fit(rank, world, offload, overlap, epochs=2, resume_from=folder / "epoch=0.ckpt",
                                 **case)
            else:
                runs[name] = fit(rank, world, offload, overlap, epochs=2, **case)
        overlapped = runs["overlapped"]
        reports.append({
            **{k: overlapped[k] for k in ("overlapped", "clipped", "speculative", "redone", "skipped", "restage",
                                          "deferred")},
            "params_overlapped": runs["params"]["overlapped"],
            "serial_overlapped": runs["serial"].get("overlapped"),
            "losses": [name for name in ("serial", "plain", "params") if runs[name]["losses"] != overlapped["losses"]]
            + [f"norms: {name}" for name in ("serial", "params") if runs[name]["norms"] != overlapped["norms"]],
            "weights": {name: _differ(overlapped, runs[name]) for name in ("serial", "plain", "params")},
        })
    return reports


class FrozenBase(GPT):
    """GPT with its first two blocks frozen (a fine-tuned base's): under offload their host copies never change."""

    def __init__(self) -> None:
        super().__init__("adamw")
        for block in self.model.blocks[:2]:
            block.requires_grad_(False)


def frozen_units_move_nothing(rank: int, world: int, offload: str) -> dict:
    """A fit whose first two blocks are frozen: how many times each unit's staging (or device) copy was made, and the
    parameters that differ from the same fit without offload."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    states = {}
    for mode in (offload, None):
        torch.manual_seed(0)
        module = FrozenBase()
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ShardStrategy(units=["Block"], offload=mode),
                            max_steps=4, logger=False, precision="bf16-mixed", use_distributed_sampler=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, torch.utils.data.DataLoader(_batches(rank, world, 1), batch_size=None))
        runtime = trainer.strategy.runtime
        states[mode] = full_state_dict(runtime, rank0_only=False)
        if mode is not None:
            copies = {unit.name: unit.storage.host.stagings + unit.storage.host.uploads for unit in runtime.units}
    return {"copies": copies, "differ": [k for k in states[None] if not torch.equal(states[None][k], states[offload][k])]}


def _outcome(rank: int, world: int, overlap: bool, case: dict) -> dict:
    try:
        return fit(rank, world, "optimizer", overlap, epochs=2, **case)
    except Exception as err:  # noqa: BLE001 - what the user sees, compared between the two
        return {"error": f"{type(err).__name__}: {err}"}


def overlapped_like_serial(rank: int, world: int, cases: dict[str, dict]) -> dict[str, object]:
    """Per named case (fit options): "same" where the overlapped fit and the serial one give the same losses and
    parameters bit for bit, ("raised", the error) where both raise it, else what differs."""
    as_lightning_rank(rank, world)
    report: dict[str, object] = {}
    for name, case in cases.items():
        overlapped, serial = _outcome(rank, world, True, case), _outcome(rank, world, False, case)
        if "error" in overlapped or "error" in serial:
            same = overlapped.get("error") == serial.get("error")
            report[name] = ("raised", serial["error"]) if same else (overlapped.get("error"), serial.get("error"))
        elif overlapped["losses"] != serial["losses"] or _differ(overlapped, serial):
            report[name] = _differ(overlapped, serial)[:3] or "losses"
        elif overlapped["norms"] != serial["norms"]:
            report[name] = "what the training step or a hook read (norms)"
        else:
            report[name] = "same" if overlapped["overlapped"] else "not overlapped"
    return report
