"""Scenarios for test_finetuning.py (issue 33), run inside a gloo world: parameter groups added, and parameters
frozen, during fit, with every kind of optimizer, against one process on the same global batches (not DDP, which
never all-reduces what was frozen when it was wrapped).

The model's layout leaves some parameters' shards empty on some ranks, where a value comparison finds them equal
to another empty shard the optimizer holds and drops them: the ranks' groups differ until the step merges them.
Lightning's own ``BaseFinetuning.filter_on_optimizer`` compares identities under the strategy
(``lightning/finetuning.py``); the scenarios filter by value as Lightning does without it (``add_by_value``), as
third-party code may.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.optim.optimizers import optimizer_kind
from lightning_shard.engine.shard_module import shard_module
from tests.optimizer_scenarios import Lamb, orthogonalise_in_fp32
from tests.world import as_lightning_rank

GLOBAL_BATCH = 6  # split evenly over 1, 2 and 3 ranks
UNITS = ["Sequential"]


class Backboned(nn.Module):
    """Two backbone blocks and a head, each a unit. On 2 and 3 ranks the second matrix of each block and the
    head's last matrix (and, with ``bias``, the blocks' biases and the head's bias) have empty shards on rank 0."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6, bias=bias), nn.Tanh(),
                                                      nn.Linear(6, 6, bias=False), nn.Tanh()) for _ in range(2)))
        self.head = nn.Sequential(nn.Linear(6, 3, bias=False), nn.Tanh(), nn.Linear(3, 1))

    def forward(self, x):
        return self.head(self.backbone(x))


def build_optimizers(model: nn.Module, name: str) -> list[torch.optim.Optimizer]:
    """From the trainable parameters, as a fine-tuning user writes it: the backbone comes later, in a group."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "muon":  # Muon for the matrices, AdamW for the rest (torch's Muon docs)
        return [torch.optim.Muon([p for _, p in trainable if p.ndim == 2], lr=0.02),
                torch.optim.AdamW([p for _, p in trainable if p.ndim != 2], lr=1e-2)]
    params = [p for _, p in trainable]
    if name == "adamw":
        return [torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)]
    if name == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2)]
    if name == "lamb":
        return [Lamb(params, lr=1e-2)]
    raise ValueError(name)


def add_by_value(module: nn.Module, optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Lightning's ``unfreeze_and_add_param_group`` as it is without the strategy: parameters equal in value to one
    the optimizer holds (``torch.equal``) are left out."""
    module.requires_grad_(True)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    params = [p for p in module.parameters() if not any(torch.equal(p, q) for q in held)]
    if params:
        optimizer.add_param_group({"params": params, "lr": lr})


def batches(n: int, seed: int = 13) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)) for _ in range(n)]


def _chunk(rank: int, world: int) -> slice:
    size = GLOBAL_BATCH // world
    return slice(rank * size, (rank + 1) * size)


# -- the engine alone ---------------------------------------------------------------------------------
def unfreeze_into_a_group(rank: int, world: int, names: list[str]) -> dict:
    """Per optimizer: the backbone frozen, unfrozen at step 2 into a group of its own by value-based filtering
    (:func:`add_by_value`), block 0 frozen again at step 4 (``BaseFinetuning.freeze``)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    report = {}
    for name in names:
        if name == "muon":
            orthogonalise_in_fp32()
        torch.manual_seed(0)
        reference = Backboned(bias=name != "muon")
        reference.backbone.requires_grad_(False)
        sharded = copy.deepcopy(reference)
        runtime = shard_module(sharded, units=UNITS)
        with runtime.shaped_parameters():
            optimizers = build_optimizers(sharded, name)
        for opt in optimizers:
            runtime.attach_optimizer(opt, whole=optimizer_kind(opt, whole=[Lamb]) == "whole")
        for model, opts, chunk in ((reference, build_optimizers(reference, name), slice(None)),
                                   (sharded, optimizers, _chunk(rank, world))):
            for step, (x, y) in enumerate(batches(6)):
                if step == 2:
                    add_by_value(model.backbone, opts[0], lr=3e-3)
                if step == 4:
                    BaseFinetuning.freeze(model.backbone[0])
                nn.functional.mse_loss(model(x[chunk]), y[chunk]).backward()
                for opt in opts:
                    runtime.step(opt) if model is sharded else opt.step()
                    opt.zero_grad(set_to_none=True)
        full = full_state_dict(runtime, rank0_only=False)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"[{name}] {k}: {m}")
        steps = [runtime.optimizers.step_of(opt) for opt in optimizers]
        report[name] = {"merged": [s.groups_merged for s in steps],
                        "groups": [[s.names[id(p)] for g in o.param_groups for p in g["params"]]
                                   for s, o in zip(steps, optimizers)]}
    return report


def added_on_one_rank(rank: int, world: int) -> str:
    """Rank 1 alone adds the backbone (its shards on rank 0 equal nothing the optimizer holds): a real difference,
    refused on every rank at the same point (the world goes on). Returns the error."""
    from lightning_shard.engine.optim.optimizer_groups import GroupMismatch

    torch.manual_seed(0)
    model = Backboned()
    model.backbone.requires_grad_(False)
    runtime = shard_module(model, units=UNITS)
    with runtime.shaped_parameters():
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    runtime.attach_optimizer(opt)
    model.backbone.requires_grad_(True)
    if rank == 1:
        opt.add_param_group({"params": list(model.backbone.parameters())})
    x, y = batches(1)[0]
    nn.functional.mse_loss(model(x[_chunk(rank, world)]), y[_chunk(rank, world)]).backward()
    try:
        runtime.step(opt)
    except GroupMismatch as err:
        return str(err)
    return "stepped"


def merges_then_refusal(rank: int, world: int, names: list[str]) -> tuple[dict, str]:
    """One world for both (a world's start costs more than a scenario)."""
    return unfreeze_into_a_group(rank, world, names), added_on_one_rank(rank, world)


# -- through Lightning ----------------------------------------------------------------------------------
def _lightning_classes():
    import lightning as L
    from lightning.pytorch.callbacks import BackboneFinetuning

    class FinetuneModule(L.LightningModule):
        def __init__(self, name: str, chunk: slice) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net, self.name, self.chunk = Backboned(bias=name != "muon"), name, chunk
            self.automatic_optimization = name != "muon"  # Lightning steps two optimizers by hand only

        @property
        def backbone(self):
            return self.net.backbone

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x[self.chunk]), y[self.chunk])
            if self.automatic_optimization:
                return loss
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()
            return None

        def configure_optimizers(self):
            return build_optimizers(self, self.name)

    class Unfreezing(BackboneFinetuning):
        """BackboneFinetuning (the backbone unfrozen at epoch 1 into a group of its own: into the Muon optimizer's
        only, when there are two), then block 0 frozen again at epoch 3. ``by_value``: its parameters filtered by
        value (:func:`add_by_value`), not by Lightning's filter."""

        def __init__(self, by_value: bool) -> None:
            super().__init__(unfreeze_backbone_at_epoch=1)
            self.by_value = by_value

        def finetune_function(self, pl_module, epoch, optimizer):
            if isinstance(optimizer, torch.optim.AdamW) and pl_module.name == "muon":
                return
            if epoch == 1 and self.by_value:
                self.previous_backbone_lr = optimizer.param_groups[0]["lr"] * self.backbone_initial_ratio_lr
                add_by_value(pl_module.backbone, optimizer, self.previous_backbone_lr)
            else:
                super().finetune_function(pl_module, epoch, optimizer)
            if epoch == 3:
                self.freeze(pl_module.backbone[0])

    return L, FinetuneModule, Unfreezing


def fit(name: str, strategy, devices: int, chunk: slice, epochs: int = 4, accumulate: int = 1,
        save_to: Optional[Path] = None, resume_from: Optional[Path] = None, by_value: bool = False):
    from lightning.pytorch.callbacks import ModelCheckpoint

    L, FinetuneModule, Unfreezing = _lightning_classes()
    if name == "muon":
        orthogonalise_in_fp32()
    module = FinetuneModule(name, chunk)
    callbacks = [Unfreezing(by_value)]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(save_to, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    # norm clipping reads the optimizer's parameters right after the backward that follows the unfreeze
    clip = None if name == "muon" else 0.5  # (Lightning clips in automatic optimization only)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs, logger=False,
                        accumulate_grad_batches=accumulate, callbacks=callbacks, use_distributed_sampler=False,
                        gradient_clip_val=clip,
                        enable_checkpointing=save_to is not None, enable_progress_bar=False,
                        enable_model_summary=False)
    data = torch.utils.data.DataLoader(batches(4), batch_size=None, collate_fn=lambda b: b)
    trainer.fit(module, data, ckpt_path=str(resume_from) if resume_from is not None else None)
    return module, trainer



def _compare(trainer, reference: nn.Module, tag: str) -> None:
    full = full_state_dict(trainer.strategy.runtime, rank0_only=False)
    # Muon's orthogonalisation normalises each update: a rounding-level difference in a tiny gradient (another
    # order of summation) moves an update by more than that, here up to 3e-6 in 16 steps
    atol = 1e-5 if reference.name == "muon" else 1e-6
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=atol, msg=lambda m, k=key: f"[{tag}] {k}: {m}")


def lightning_finetuning(rank: int, world: int, cases: list[tuple[str, int, Optional[str], bool]],
                         save_dir: Optional[str] = None) -> list[dict]:
    """Each case ``(optimizer, accumulate_grad_batches, checkpoint kind to save every epoch or None, by value)``
    under ShardStrategy on this world against one process, uninterrupted, on the same global batches."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    results = []
    for name, accumulate, kind, by_value in cases:
        save_to = Path(save_dir) / f"{name}-{kind}" if kind is not None else None
        strategy = ShardStrategy(units=UNITS, matrix_optimizers=[Lamb], state_dict_type=kind or "sharded")
        sharded, trainer = fit(name, strategy, world, _chunk(rank, world), accumulate=accumulate, save_to=save_to,
                               by_value=by_value)
        reference, _ = fit(name, "auto", 1, slice(None), accumulate=accumulate, by_value=by_value)
        _compare(trainer, reference, f"{name}, accumulate {accumulate}")
        steps = [trainer.strategy.runtime.optimizers.step_of(opt) for opt in trainer.optimizers]
        results.append({"merged": sum(s.groups_merged for s in steps),
                        "groups": [[len(g["params"]) for g in opt.param_groups] for opt in trainer.optimizers],
                        "trainable": [n for n, p in sharded.named_parameters() if p.requires_grad]})
    return results


def lightning_resume(rank: int, world: int, cases: list[tuple[str, str, bool]], save_dir: str) -> list[dict]:
    """Each case ``(optimizer, checkpoint kind)``: resume from the checkpoint written after epoch 1 (just after
    the unfreeze) by :func:`lightning_finetuning` on another number of ranks, train on to the end, and compare
    with one process that never stopped."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    results = []
    for name, kind, by_value in cases:
        checkpoint = Path(save_dir) / f"{name}-{kind}" / "epoch=1.ckpt"
        strategy = ShardStrategy(units=UNITS, matrix_optimizers=[Lamb], state_dict_type=kind)
        resumed, trainer = fit(name, strategy, world, _chunk(rank, world), resume_from=checkpoint, by_value=by_value)
        reference, _ = fit(name, "auto", 1, slice(None), by_value=by_value)
        _compare(trainer, reference, f"{name} resumed from {kind} on {world} ranks")
        results.append({"groups": [[len(g["params"]) for g in opt.param_groups] for opt in trainer.optimizers]})
    dist.barrier()
    return results


# -- figures for the README: `python -m tests.finetuning_scenarios` ----------------------------------------
def error_against_one_process(rank: int, world: int, strategy: str, save_dir: str) -> float:
    """The largest parameter difference from one process after BackboneFinetuning with AdamW (4 epochs), under
    ``strategy`` on this world; ``"resumed"``: plain Lightning in one process, stopped after epoch 1 and resumed."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    if strategy == "shard":
        _, trainer = fit("adamw", ShardStrategy(units=UNITS), world, _chunk(rank, world))
        state = full_state_dict(trainer.strategy.runtime, rank0_only=False)
    elif strategy == "resumed":
        fit("adamw", "auto", 1, slice(None), epochs=2, save_to=Path(save_dir))
        module, _ = fit("adamw", "auto", 1, slice(None), resume_from=Path(save_dir) / "epoch=1.ckpt")
        state = module.state_dict()
    else:
        module, _ = fit("adamw", strategy, world, _chunk(rank, world))
        state = module.state_dict()
    reference, _ = fit("adamw", "auto", 1, slice(None))
    return max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items())


if __name__ == "__main__":
    import tempfile

    from tests.world import run_world

    for strategy, world in (("ddp", 2), ("shard", 2), ("resumed", 1)):
        with tempfile.TemporaryDirectory() as directory:
            errors = run_world(error_against_one_process, world, strategy, directory, timeout=600)
        print(f"{strategy} on {world} ranks: largest difference from one process {max(errors):.1e}")
