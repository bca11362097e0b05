"""Writes to parameters outside the optimizer (issue 49), in a gloo world against one process on the same global
batch: a weight constraint (WGAN's clipping) where README advises it and where users put it, and a momentum
teacher (MoCo, BYOL, DINO) updated from its student in place or by ``p.data = ...``."""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests.exactness_scenarios import assert_matches

CLIP = 0.15


class Block(nn.Module):
    """7 features: pieces straddle the shards' boundaries at 2 and 3 ranks. ``clamps``: clips its own weight under
    no_grad at the start of its forward (a constraint written inside the forward)."""

    def __init__(self, clamps: bool = False) -> None:
        super().__init__()
        self.lin, self.clamps = nn.Linear(7, 7), clamps

    def forward(self, x):
        if self.clamps:
            with torch.no_grad():
                self.lin.weight.clamp_(-CLIP, CLIP)
        return torch.tanh(self.lin(x))


class Critic(nn.Module):
    def __init__(self, clamps: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(clamps) for _ in range(2))
        self.head = nn.Linear(7, 1)  # the root unit's

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _clip(module: nn.Module) -> None:
    for p in module.parameters():
        p.data.clamp_(-CLIP, CLIP)  # as WGAN writes it (no version counter moves)


def constraint(rank: int, world: int, cases: list[tuple[str, str]], steps: int = 4) -> list:
    """Per (sharding, where): SGD steps with WGAN's clipping of every weight, against one process. ``where``:
    ``"on_before_zero_grad"`` (Lightning's order: the step's forward, the hook, zero_grad, backward, the optimizer
    step), ``"after_manual_step"`` (inside the step, after ``opt.step()``), ``"between_steps"`` (after the optimizer
    step, outside any step: ``on_train_batch_end``), ``"in_forward"`` (each block clips its own weight)."""
    done = []
    for sharding, where in cases:
        torch.manual_seed(0)
        reference = Critic(clamps=where == "in_forward")
        model = copy.deepcopy(reference)
        runtime = shard_module(model, sharding=sharding, units=["Block"], shard_size=1 if sharding == "hybrid" else None)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            x = torch.randn(2 * world, 7, generator=g)
            loss_of = lambda m, data: m(data).pow(2).mean()  # noqa: E731
            if where == "on_before_zero_grad":
                loss, ref_loss = runtime.run_step(lambda: loss_of(model, x.chunk(world)[rank])), loss_of(reference, x)
                if step:  # after this step's forward, before its backward: the backward reads the clipped weights
                    _clip(model)
                    _clip(reference)
                opt.zero_grad()
                ref_opt.zero_grad()
                loss.backward()
                ref_loss.backward()
                opt.step()
                runtime.after_optimizer_step()
                ref_opt.step()
                continue

            def train_step():
                loss_of(model, x.chunk(world)[rank]).backward()
                opt.step()
                runtime.after_optimizer_step()
                opt.zero_grad()
                if where == "after_manual_step":
                    _clip(model)

            runtime.run_step(train_step)
            loss_of(reference, x).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            if where in ("after_manual_step", "between_steps"):
                _clip(reference)
            if where == "between_steps":
                _clip(model)
        assert_matches(runtime, reference, f"{sharding} {where}")
        done.append((sharding, where))
    return done


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Momentum(nn.Module):
    """A student and its momentum teacher (a frozen copy), updated in forward: ``"first"`` (MoCo v3's order: before
    the student's forward) or ``"between"`` (MoCo v2's: between the student's forward and the teacher's, whose first
    unit's all-gather is then in flight), or by the caller (``None``: after the optimizer step, as BYOL and DINO do).
    ``rebind``: ``t.data = ...`` (as MoCo writes it), else ``t.mul_(m).add_(s)``."""

    def __init__(self, in_forward=None, rebind: bool = False, m: float = 0.75) -> None:
        super().__init__()
        self.student = Encoder()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.in_forward, self.rebind, self.m = in_forward, rebind, m

    @torch.no_grad()
    def update_teacher(self) -> None:
        for t, s in zip(self.teacher.parameters(), self.student.parameters()):
            if self.rebind:
                t.data = t.data * self.m + s.data * (1 - self.m)
            else:
                t.mul_(self.m).add_(s, alpha=1 - self.m)

    def forward(self, x):
        if self.in_forward == "first":
            self.update_teacher()
        q = self.student(x)
        if self.in_forward == "between":
            self.update_teacher()
        with torch.no_grad():
            k = self.teacher(x * 0.5)
        return (q - k).pow(2).mean()


def momentum(rank: int, world: int, cases: list[tuple], steps: int = 3) -> list:
    """Per (sharding, units, in forward, rebind): Adam on the student, the teacher updated from it at every step,
    against one process. ``units="Encoder"`` lays student and teacher out alike (each a unit, blocks nested);
    ``units="Block"`` leaves both heads in the root unit, at other offsets: between steps their 1-D shards are other
    elements (a warning at setup says so), inside the step the root is gathered and the update exact. Returns each
    case with whether that warning came."""
    done = []
    for sharding, units, in_forward, rebind in cases:
        torch.manual_seed(0)
        reference = Momentum(in_forward, rebind)
        model = copy.deepcopy(reference)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runtime = shard_module(model, sharding=sharding, units=[units, "Block"] if units == "Encoder" else [units])
        warned = any("is a frozen copy laid out otherwise" in str(w.message) for w in caught)
        opt, ref_opt = (torch.optim.Adam(m.student.parameters(), lr=1e-2) for m in (model, reference))
        g = torch.Generator().manual_seed(2)
        for _ in range(steps):
            x = torch.randn(2 * world, 7, generator=g)
            runtime.run_step(lambda: model(x.chunk(world)[rank])).backward()
            reference(x).backward()
            opt.step()
            runtime.after_optimizer_step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            if in_forward is None:
                model.update_teacher()
                reference.update_teacher()
        assert_matches(runtime, reference, f"{sharding} {units} in_forward={in_forward} rebind={rebind}")
        done.append((sharding, units, in_forward, rebind, warned))
    return done


def misaligned_teacher(rank: int, world: int) -> str:
    """Both heads in the root unit, the teacher updated between steps on its 1-D shards: what torch says."""
    try:
        momentum(rank, world, [("full", "Block", None, False)])
    except RuntimeError as err:
        return str(err)
    return "trained"


def lightning_wgan(rank: int, world: int, sharding: str, micro: int = 2, steps: int = 3) -> dict:
    """The README's advice through a real Trainer: WGAN's clipping in ``on_before_zero_grad``, with
    ``accumulate_grad_batches=2`` and ``nonfinite="skip"``, the loss of the first micro-batch of step 1 infinite. One
    process on the global batches in Lightning's order: a window's first micro-batch runs its forward, the hook (the
    clipping) and zero_grad, then its backward (which reads the clipped weights); the step whose micro-batch was
    infinite is skipped whole."""
    import lightning as L

    from lightning_shard import ShardStrategy
    from tests.world import as_lightning_rank

    class Wgan(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.critic = Critic()

        def training_step(self, batch, batch_idx):
            loss = self.critic(batch).pow(2).mean()
            return loss * float("inf") if batch_idx == micro else loss

        def on_before_zero_grad(self, optimizer) -> None:
            _clip(self.critic)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    as_lightning_rank(rank, world)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(2 * world, 7, generator=g) for _ in range(micro * steps)]
    torch.manual_seed(0)
    module = Wgan()
    reference = copy.deepcopy(module.critic)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ShardStrategy(sharding=sharding, units=["Block"],
                                                                              nonfinite="skip"),
                        accumulate_grad_batches=micro, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader([b.chunk(world)[rank] for b in batches], batch_size=None))
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for i, x in enumerate(batches):
        loss = reference(x).pow(2).mean() / micro
        if i % micro == 0:
            _clip(reference)
            opt.zero_grad()
        loss.backward()
        if i % micro == micro - 1 and i // micro != 1:
            opt.step()
    expected = {f"critic.{k}": v for k, v in reference.state_dict().items()}
    full = full_state_dict(trainer.strategy.runtime, rank0_only=False)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"[{sharding}] {n}: {m}")
    return {"skipped": trainer.strategy.runtime.skipped_steps, "steps": trainer.global_step}


def _clipped_gpt(where: str):
    """host_step_scenarios.GPT (TinyGPT, AdamW) whose every weight is clipped through ``.data`` (WGAN's way) where
    ``where`` says: ``"training_step"`` (at its top, before the forward: the step's root is gathered, no other unit),
    ``"on_before_zero_grad"`` (after the forward, before the backward: README's advice) or ``"in_forward"`` (each block
    clips its own weights inside its forward, where it is gathered)."""
    from tests.host_step_scenarios import GPT

    class Clipped(GPT):
        def __init__(self) -> None:
            super().__init__("adamw", in_step=("clamp",) if where == "training_step" else ())
            if where == "in_forward":  # (a pre-hook of its first layer: inside the block's forward)
                for block in self.model.blocks:
                    block.ln1.register_forward_pre_hook(lambda module, args, block=block: _clip(block))

    if where == "on_before_zero_grad":
        Clipped.on_before_zero_grad = lambda self, optimizer: _clip(self)
    return Clipped


def lightning_constraints(rank: int, world: int, cases: list[tuple[str, Optional[str], bool]]) -> dict:
    """Per (where, offload, offload_overlap): the largest difference of the weights after a Lightning fit (32-true,
    2 epochs) from DDP's with the same clipping."""
    import lightning as L

    from lightning_shard import ShardStrategy
    from tests.host_step_scenarios import _batches
    from tests.world import as_lightning_rank

    as_lightning_rank(rank, world)

    def fit(where: str, strategy) -> dict:
        torch.manual_seed(0)
        module = _clipped_gpt(where)()
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=2, logger=False,
                            precision="32-true", use_distributed_sampler=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, torch.utils.data.DataLoader(_batches(rank, world, 2), batch_size=None))
        if isinstance(strategy, ShardStrategy):
            return full_state_dict(trainer.strategy.runtime, rank0_only=False)
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    report, references = {}, {}
    for where, offload, overlap in cases:
        if where not in references:
            references[where] = fit(where, "ddp")
        state = fit(where, ShardStrategy(units=["Block"], offload=offload, offload_overlap=overlap))
        report[(where, offload, overlap)] = max(float((state[k] - ref).abs().max())
                                                for k, ref in references[where].items())
    return report
