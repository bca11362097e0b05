"""Optimizer scenarios, run inside a gloo world: optimizers whose update reads whole parameters (Muon, Adafactor, a
LAMB written here) against DDP with the same optimizer on full tensors (test_matrix_optimizers.py), and optimizers
refused at setup, naming why (test_exactness.py)."""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.optim.optimizers import optimizer_kind
from lightning_shard.engine.shard_module import shard_module
from tests import models


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019): Adam's update scaled per parameter by ``||w|| / ||update||``. Its ``step`` count is a
    Python int, non-tensor state that checkpoints must carry too."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (m / (1 - beta1 ** state["step"])) / ((v / (1 - beta2 ** state["step"])).sqrt() + group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = float(p.norm()), float(update.norm())
                trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)
        return loss


def decay_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    decay = [p for n, p in params if p.requires_grad and p.ndim >= 2]  # shapes, as nanoGPT: the placeholders' job
    rest = [p for n, p in params if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def orthogonalise_in_fp32() -> None:
    """torch's Muon runs its Newton-Schulz iteration in bf16, where a 1-ulp difference in a gradient (a clipping
    coefficient computed from shards rather than from whole tensors) can round differently and grow step by step.
    In fp32 the same code keeps such differences at rounding level, so the comparison with DDP is tight."""
    import torch.optim._muon as muon

    def newton_schulz(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.T if grad.size(0) > grad.size(1) else grad.clone()
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    muon._zeropower_via_newtonschulz = newton_schulz


def build_optimizers(model: nn.Module, name: str) -> list[torch.optim.Optimizer]:
    """As a user writes them, from names and shapes: Muon for the 2-D weights with AdamW for the rest (torch's
    Muon docs), Adafactor, LAMB, each with weight-decay groups."""
    named = list(model.named_parameters())
    if name in ("muon", "muon_bf16"):
        matrices = [(n, p) for n, p in named if p.ndim == 2]
        others = [(n, p) for n, p in named if p.ndim != 2]
        return [torch.optim.Muon([p for _, p in matrices], lr=0.02, weight_decay=0.01),
                torch.optim.AdamW(decay_groups(others, 0.1), lr=1e-2)]
    if name == "adafactor":
        return [torch.optim.Adafactor(decay_groups(named, 0.01), lr=1e-2)]
    if name == "adamw":  # foreach: its list-wide temporaries are what step groups bound (the CPU default loops)
        return [torch.optim.AdamW(decay_groups(named, 0.1), lr=1e-2, foreach=True)]
    if name == "lamb":
        return [Lamb(decay_groups(named, 0.01), lr=1e-2)]
    raise ValueError(name)


def train(model, optimizers, batches, rank, world, clip=None, runtime=None):
    losses = []
    for step, batch in enumerate(batches):
        loss = models.TinyGPT.loss(model, batch.chunk(world)[rank], step)
        loss.backward()
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        if clip is not None and runtime is None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        elif clip is not None:
            runtime.clip_grad_norm_(params, clip)
        for opt in optimizers:
            opt.step() if runtime is None else runtime.step(opt)
            opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses


def state_bytes(optimizers, per_param: bool = False):
    sizes = [sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
             for opt in optimizers for s in opt.state.values()]
    return sizes if per_param else sum(sizes)


def parity_all(rank: int, world: int, names: list[str], group_numel: int) -> dict:
    """Every optimizer in one world; torch's own Muon (bf16 orthogonalisation) without clipping, the rest with."""
    return {name: parity(rank, world, name, clip=None if name == "muon_bf16" else 0.5, group_numel=group_numel)
            for name in names}


def parity(rank: int, world: int, name: str, modes=("full", "grad_op", "none"), steps: int = 20,
           clip: Optional[float] = 0.5, group_numel: int = 2**25, **policy) -> dict:
    if name == "muon":
        orthogonalise_in_fp32()
    g = torch.Generator().manual_seed(1234)
    batches = [models.TinyGPT.batch(g, 12) for _ in range(steps)]
    report = {}
    for mode in modes:
        torch.manual_seed(0)
        reference = models.TinyGPT(d=16, n_blocks=3)
        sharded = copy.deepcopy(reference)
        ddp = DDP(reference)
        ref_opts = build_optimizers(reference, name)
        expected_losses = train(ddp, ref_opts, batches, rank, world, clip)

        runtime = shard_module(sharded, sharding=mode, **policy)
        with runtime.shaped_parameters():
            opts = build_optimizers(sharded, name)
        for opt in opts:
            runtime.attach_optimizer(opt, optimizer_kind(opt, whole=[Lamb]) == "whole", group_numel)
        losses = train(sharded, opts, batches, rank, world, clip, runtime)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"[{name}/{mode}] per-step losses differ from DDP: {m}")
        full = full_state_dict(runtime, rank0_only=False)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"[{name}/{mode}] parameter {k}: {m}")
        report[mode] = {"losses": losses, "state_bytes": state_bytes(opts), "ddp_state_bytes": state_bytes(ref_opts),
                        "largest_param_state": max(state_bytes(ref_opts, per_param=True)),
                        "groups": [len(runtime.optimizers.step_of(opt).plan().buckets) for opt in opts]}
    return report


def _sharded(name: str, seed: int, world: int, **policy) -> tuple[nn.Module, object, list[torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = models.TinyGPT(d=16, n_blocks=3)
    runtime = shard_module(model, **policy)
    with runtime.shaped_parameters():
        optimizers = build_optimizers(model, name)
    for opt in optimizers:
        runtime.attach_optimizer(opt, whole=optimizer_kind(opt, whole=[Lamb]) == "whole")
    return model, runtime, optimizers


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [models.TinyGPT.batch(g, 12) for _ in range(n)]


def save_then_continue(rank: int, world: int, names: list[str], path: str, state_dict_type: str) -> dict:
    """Per optimizer: 3 steps, save, 2 more steps. Returns the full optimizer states saved and the 2 losses."""
    from pathlib import Path

    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.full import full_optimizer_state_dict
    from lightning_shard.checkpoint.io import save_sharded

    orthogonalise_in_fp32()
    report = {}
    for name in names:
        model, runtime, opts = _sharded(name, 0, world)
        train(model, opts, _batches(1, 3), rank, world, 0.5, runtime)
        full = [full_optimizer_state_dict(runtime, opt, rank0_only=False) for opt in opts]
        if state_dict_type == "sharded":
            save_sharded({"state_dict": sharded.model_state(runtime),
                          "optimizer_states": [sharded.optimizer_state(runtime, opt) for opt in opts]},
                         Path(path) / name)
        else:
            weights = full_state_dict(runtime, rank0_only=False)
            if rank == 0:
                torch.save({"state_dict": weights, "optimizer_states": full}, Path(path) / f"{name}.ckpt")
        dist.barrier()
        report[name] = {"optimizers": full, "after": train(model, opts, _batches(2, 2), rank, world, 0.5, runtime),
                        "state_bytes": state_bytes(opts)}
    return report


def load_then_continue(rank: int, world: int, names: list[str], path: str, state_dict_type: str) -> dict:
    """A differently seeded model with other units: load, report the full optimizer states, train 2 steps."""
    from pathlib import Path

    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.full import (
        full_optimizer_state_dict,
        load_full_optimizer_state_dict,
        load_full_state_dict,
    )
    from lightning_shard.checkpoint.io import open_checkpoint

    orthogonalise_in_fp32()
    report = {}
    for name in names:
        model, runtime, opts = _sharded(name, 99, world, unit_size=900)
        if state_dict_type == "sharded":
            checkpoint = open_checkpoint(Path(path) / name)
            source = checkpoint["state_dict"]
            sharded.load_model_state(runtime, source.directory, source.metadata)
            for i, opt in enumerate(opts):
                sharded.load_optimizer_state(runtime, opt, i, checkpoint["optimizer_states"][i], source.directory,
                                             source.metadata)
        else:
            checkpoint = torch.load(Path(path) / f"{name}.ckpt", weights_only=True)
            load_full_state_dict(runtime, checkpoint["state_dict"])
            for opt, state in zip(opts, checkpoint["optimizer_states"]):
                load_full_optimizer_state_dict(runtime, opt, state)
        report[name] = {"optimizers": [full_optimizer_state_dict(runtime, opt, rank0_only=False) for opt in opts],
                        "after": train(model, opts, _batches(2, 2), rank, world, 0.5, runtime),
                        "state_bytes": state_bytes(opts)}
    return report


def mixed_precision(rank: int, world: int) -> dict:
    """bf16 gathers and compute, fp32 masters: owners step fp32 values with fp32 state; a non-finite step is
    skipped on every rank (``nonfinite="skip"``), the owners included."""
    torch.manual_seed(0)
    model = models.TinyGPT(d=16, n_blocks=3)
    runtime = shard_module(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, nonfinite="skip")
    with runtime.shaped_parameters():
        opts = build_optimizers(model, "muon")
    runtime.attach_optimizer(opts[0], whole=True)
    runtime.attach_optimizer(opts[1])
    batches = _batches(3, 12)
    losses = train(model, opts, batches[:10], rank, world, 0.5, runtime)
    before = full_state_dict(runtime, rank0_only=False)
    loss = models.TinyGPT.loss(model, batches[10].chunk(world)[rank], 0) * float("nan")  # a NaN loss on every rank
    loss.backward()
    for opt in opts:
        runtime.step(opt)
        opt.zero_grad(set_to_none=True)
    after = full_state_dict(runtime, rank0_only=False)
    return {"losses": losses, "skipped": runtime.skipped_steps,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "shard_dtypes": sorted({str(u.storage.shard.dtype) for u in runtime.units}),
            "gathered_dtypes": sorted({str(u.storage.gathered.dtype) for u in runtime.units}),
            "state_dtypes": sorted({str(v.dtype) for opt in opts for s in opt.state.values() for k, v in s.items()
                                    if isinstance(v, torch.Tensor) and k != "step"})}


class MyAdamW(torch.optim.AdamW):
    """A user's own optimizer: its class decides its kind, not its base, so it must be declared."""


def optimizer_refused(rank: int, world: int, optimizer: str, declare: str = ""):
    """An optimizer neither known nor declared is refused at setup, naming it and how to declare it; a refused
    one (LBFGS) says why; known and declared ones train."""
    import lightning as L

    from lightning_shard import ShardStrategy

    cls = MyAdamW if optimizer == "MyAdamW" else getattr(torch.optim, optimizer)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

        def training_step(self, batch, _):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return cls(self.parameters(), lr=1e-3)

    strategy = ShardStrategy(**({f"{declare}_optimizers": [cls]} if declare else {}))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Module(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))
    except ValueError as err:
        return str(err)
    return "trained"


def optimizer_refusals(rank: int, world: int) -> list[str]:
    """``optimizer_refused``'s cases in one world: an unknown class, LBFGS, the class declared either way, Adafactor."""
    return [optimizer_refused(rank, world, "MyAdamW"), optimizer_refused(rank, world, "LBFGS"),
            optimizer_refused(rank, world, "MyAdamW", "elementwise"), optimizer_refused(rank, world, "MyAdamW", "matrix"),
            optimizer_refused(rank, world, "Adafactor")]


def adagrad_like_ddp(rank: int, world: int, steps: int = 4) -> bool:
    """torch's Adagrad builds its accumulators when it is built, over the full-shape placeholders
    ``configure_optimizers`` sees: they are built again on the shards (it was refused), and training matches DDP."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    model = copy.deepcopy(reference)
    runtime = shard_module(model, units=["Linear"])
    with runtime.shaped_parameters():
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5, lr_decay=0.01)
    runtime.attach_optimizer(optimizer)
    ddp = DDP(reference)
    ddp_optimizer = torch.optim.Adagrad(ddp.parameters(), lr=0.1, initial_accumulator_value=0.5, lr_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 1, generator=g)
        for net, opt in ((model, optimizer), (ddp, ddp_optimizer)):
            nn.functional.mse_loss(net(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            runtime.step(opt) if net is model else opt.step()
            opt.zero_grad(set_to_none=True)
    full = full_state_dict(runtime, rank0_only=False)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    return all(state["sum"].shape == p.shape for p, state in optimizer.state.items())  # the shards' own
