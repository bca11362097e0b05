"""Scenarios run inside a gloo world (see world.py): the sharded model against DDP on the same batch."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_shard.engine.shard_module import shard_module
from lightning_shard.checkpoint.full import full_state_dict
from tests import models

SCENARIOS = {
    # name: (model class, shard_module kwargs)
    "gpt": (models.TinyGPT, {}),
    "gpt_unit_size": (models.TinyGPT, {"unit_size": 700}),
    "gpt_merged_units": (models.TinyGPT, {"units": ["Block"], "min_unit_size": 2500}),  # the 3 blocks in one unit
    # units of two blocks, the first fed raw data: its backward ends after the second's
    "raw_input_merged_units": (models.RawInputStack, {"units": ["Sequential"], "min_unit_size": 100}),
    "tied_split": (models.SplitTiedGPT, {"units": ["Embed", "Head", "Block"]}),
    "odd": (models.Odd, {"unit_size": 9}),
    "frozen": (models.FrozenMix, {}),
    "misc": (models.Misc, {"units": ["Twice", "Rare", "BatchNorm1d"]}),
    "reorder": (models.Reorder, {}),
    "untied_embedding": (models.UntiedLM, {"units": ["Embedding", "Block"]}),
    "checkpointed_blocks": (models.CheckpointedLM, {"units": ["Embedding", "Block"]}),
    "raw_input_stem": (models.RawInputStem, {"units": ["Conv1d", "LayerNorm"]}),
    "gpt_checkpointed": (models.TinyGPT, {"activation_checkpointing": True}),
    "gpt_checkpointed_inner": (models.TinyGPT, {"units": ["Block"],
                                                "activation_checkpointing": ["MultiheadAttention", "Sequential"]}),
    "cross_view_out": (models.CrossViewOut, {"units": ["CrossBlock", "ViewOut", "Halves"]}),
    "untied_checkpointed": (models.UntiedLM, {"units": ["Embedding", "Block"], "activation_checkpointing": True}),
    "gradient_penalty": (models.Penalized, {"units": ["TanhBlock"]}),
}

ORDER_WARNING = "order in which units run changed"


def param_groups(model: nn.Module) -> list[dict]:
    """No weight decay on biases, norms and scalars: built from names, as users do."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith("bias") or "ln" in name or "norm" in name or "scale" in name else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def train(model, loss_fn, batches, rank, world, accumulate=1, clip=None, runtime=None, defer=None, norms=None):
    """``defer``: what the sharded model skips on non-final micro-batches (``"replicas"``: the all-reduce across
    replicas, ``"all"``: every reduction; default: nothing). ``norms``: a list to append the clipped norms to."""
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    losses = []
    for step, batch in enumerate(batches):
        local = batch.chunk(world)[rank]
        micro = local.chunk(accumulate)
        total = 0.0
        for i, mb in enumerate(micro):
            sync = i == accumulate - 1
            ctx = _null()
            if isinstance(model, DDP) and not sync:
                ctx = model.no_sync()
            elif runtime is not None and defer is not None and not sync:
                ctx = runtime.no_replica_sync() if defer == "replicas" else runtime.no_sync()
            with ctx:
                loss = loss_fn(model, mb, step) / accumulate
                loss.backward()
            total += loss.detach()
        if clip is not None:
            if runtime is None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                norm = runtime.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
            if norms is not None:
                norms.append(norm.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def parity_all(rank: int, world: int) -> dict[str, dict]:
    """Every scenario in one world (a world's start costs more than a scenario): per scenario, ``parity``'s report."""
    return {scenario: parity(rank, world, scenario) for scenario in sorted(SCENARIOS)}


def parity(rank: int, world: int, scenario: str, modes=("full", "grad_op", "none"), steps=20, accumulate=1, clip=None,
           offload=None):
    model_cls, kwargs = SCENARIOS[scenario]
    g = torch.Generator().manual_seed(1234)
    batches = [model_cls.batch(g, 12 * accumulate) for _ in range(steps)]
    report = {}
    for mode in modes:
        torch.manual_seed(0)
        reference = model_cls()
        sharded = copy.deepcopy(reference)
        ddp = DDP(reference, find_unused_parameters=scenario == "misc")
        ref_losses = train(ddp, model_cls.loss, batches, rank, world, accumulate, clip)

        runtime = shard_module(sharded, sharding=mode, offload=offload, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train(sharded, model_cls.loss, batches, rank, world, accumulate, clip, runtime=runtime)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"[{scenario}/{mode}/{offload}] per-step losses differ from DDP: {m}")
        full = full_state_dict(runtime, rank0_only=False)
        expected = reference.state_dict()
        assert full.keys() == expected.keys(), (full.keys(), expected.keys())
        for name, value in expected.items():
            if "running" in name or "num_batches" in name:
                if rank == 0:  # a full state dict holds rank 0's buffers; DDP's other ranks keep their last update
                    torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
                continue
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"[{scenario}/{mode}] parameter {n}: {m}")
        report[mode] = {"units": len(runtime.units), "first_loss": losses[0], "last_loss": losses[-1],
                        "order_warnings": sum(ORDER_WARNING in str(w.message) for w in caught)}
    return report


def memory(rank: int, world: int, mode: str = "full", prefetch: int = 1):
    """Bytes of parameters, gradients and optimizer state held by this rank, and gathered units alive."""
    torch.manual_seed(0)
    model = models.TinyGPT(d=16, n_blocks=4)
    unsharded = sum(p.numel() for p in model.parameters()) * 4
    runtime = shard_module(model, sharding=mode, prefetch=prefetch)
    units = runtime.units
    alive = []

    def sample(*_):  # gathered (or being gathered) units other than the root
        alive.append(sum(u.storage.is_allocated for u in units if not u.storage.aliases_shard and u is not runtime.root_unit))

    for unit in units:
        for member in unit.members:
            member.register_forward_pre_hook(sample)  # runs after the runtime's own pre-forward hook
            member.register_forward_hook(sample)
        for p in unit.storage.gathered_params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(sample)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), step).backward()
        opt.step()
    param_bytes = sum(u.storage.shard.numel() * 4 for u in units)
    grad_bytes = sum(u.storage.shard_grad.numel() * 4 for u in units if u.storage.shard_grad is not None)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    gathered_after_step = sum(u.storage.is_allocated for u in units if not u.storage.aliases_shard)
    padding_bytes = sum((u.storage.padded_numel - sum(s.numel for s in u.storage.slots)) * 4 for u in units)
    return dict(unsharded=unsharded, param=param_bytes, grad=grad_bytes, state=state_bytes,
                padding=padding_bytes, max_alive=max(alive), after_step=gathered_after_step, units=len(units))


def collective_trace(rank: int, world: int, prefetch: int):
    """The collectives of the second step (the first records the execution order), in issue order."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    runtime = shard_module(model, sharding="full", prefetch=prefetch)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        runtime.trace = [] if step == 1 else None
        models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), step).backward()
    return runtime.trace


def gathered_peak(rank: int, world: int, prefetch: int, param_dtype: torch.dtype) -> dict:
    """The second step's peak of gathered bytes, and each unit's gathered bytes."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    runtime = shard_module(model, sharding="full", prefetch=prefetch, param_dtype=param_dtype)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        runtime.schedule.peak_gathered_bytes = runtime.schedule.gathered_bytes
        models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), step).backward()
    return {"peak": runtime.schedule.peak_gathered_bytes,
            "units": {u.name: u.storage.gathered_nbytes for u in runtime.units}}


def bytes_per_step(rank: int, world: int, mode: str):
    torch.manual_seed(0)
    model = models.TinyGPT()
    runtime = shard_module(model, sharding=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), step).backward()
        opt.step()
        runtime.after_optimizer_step()
    padded = {u.name: u.storage.padded_numel * 4 for u in runtime.units}
    return {"stats": runtime.last_step_stats, "padded": padded, "last": runtime.order[-1].name}


def backward_gathers(rank: int, world: int, scenario: str, steps: int = 3):
    """Per unit: all-gathers issued and backward gathers skipped; and the run's losses and parameters, with
    the elision on and off (they must be identical)."""
    model_cls, kwargs = SCENARIOS[scenario]
    g = torch.Generator().manual_seed(7)
    batches = [model_cls.batch(g, 12) for _ in range(steps)]
    report = {}
    for elide in (True, False):
        torch.manual_seed(0)
        model = model_cls()
        runtime = shard_module(model, elide_backward_gathers=elide, **kwargs)
        runtime.trace = []
        skipped = []
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for batch in batches:
            loss = model_cls.loss(model, batch.chunk(world)[rank], 0)
            loss.backward()
            skipped.append(runtime.stats.skipped_gathers)
            opt.step()
            opt.zero_grad(set_to_none=True)
            runtime.after_optimizer_step()
            losses.append(loss.item())
        gathers = {}
        for op, unit in runtime.trace:
            gathers.setdefault(unit, {"all_gather": 0, "skip_gather": 0, "reduce": 0})
            gathers[unit][op] = gathers[unit].get(op, 0) + 1
        report[elide] = {"losses": losses, "state": full_state_dict(runtime, rank0_only=False),
                         "per_unit": gathers, "skipped_per_step": skipped}
    return report


class _WritesItsInput(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rank = rank

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:  # on one rank only: data-dependent, say
            h.mul_(0.5)
        return self.lin(h * 1)


def write_input_in_place(rank: int, world: int) -> None:
    """A unit that writes its input in place on rank 0: that rank stops at once (the write would drop the node that
    sees the unit's backward end, and rank 0 alone would reduce the unit late: mismatched collectives)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _WritesItsInput(rank), nn.Linear(4, 1))
    shard_module(model, units=["_WritesItsInput"])
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()


def gathers_per_step(rank: int, world: int, cases: list[dict], steps: int = 3) -> list[list[dict[str, int]]]:
    """Per case (``shard_module`` options, ``run_step``: the strategy's way in), the all-gathers of each unit in each
    step (an untied LM, its token embedding a unit of its own, with the elision on)."""
    out = []
    for case in cases:
        case = dict(case)
        through_run_step = case.pop("run_step", False)
        torch.manual_seed(0)
        model = models.UntiedLM()
        runtime = shard_module(model, units=["Embedding", "Block"], elide_backward_gathers=True, **case)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(7)
        counts = []
        for _ in range(steps):
            runtime.trace = []
            batch = models.UntiedLM.batch(g, 4 * world).chunk(world)[rank]
            loss = (runtime.run_step(models.UntiedLM.loss, model, batch, 0) if through_run_step
                    else models.UntiedLM.loss(model, batch, 0))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            runtime.after_optimizer_step()
            per_unit: dict[str, int] = {}
            for op, unit in runtime.trace:
                if op == "all_gather":
                    per_unit[unit] = per_unit.get(unit, 0) + 1
            counts.append(per_unit)
        out.append(counts)
    return out
