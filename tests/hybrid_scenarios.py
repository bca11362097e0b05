"""Hybrid sharding (HSDP) inside a gloo world of R replicas x G ranks (see world.py): against DDP on the same
global batch, communication and memory against the README's formulas, replicas bit-identical, a checkpoint
saved for other worlds to load. One world runs them all (a 4-rank world's start costs more than a scenario)."""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_shard.app.models.gpt import GPT
from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests import checkpoint_scenarios, models, optimizer_scenarios
from tests.engine_scenarios import train


def hybrid_world(rank: int, world: int, shard_size: int, path: str) -> dict:
    policy = {"sharding": "hybrid", "shard_size": shard_size}
    return {
        "parity": parity(rank, world, policy),
        "bytes": bytes_per_step(rank, world, policy),
        "memory": memory(rank, world, policy),
        "nonfinite": nonfinite_skipped_everywhere(rank, world, policy),
        # owners step whole parameters within their shard group; every replica's owner steps the same ones
        "adafactor": optimizer_scenarios.parity(rank, world, "adafactor", modes=("hybrid",), steps=6,
                                                shard_size=shard_size)["hybrid"],
        "checkpoint": checkpoint_scenarios.save_then_continue(rank, world, "gpt", policy, path),
        "options": options_as_under_full(rank, world, shard_size),
        "habits": accumulation_habits(rank, world, policy),
        "own_mesh": own_mesh(rank, world, shard_size),
    }


def parity(rank: int, world: int, policy: dict, steps: int = 20) -> dict:
    """Accumulation over 2 micro-batches (the all-reduce across replicas deferred, or every reduction) and norm
    clipping, against DDP: losses, clipped norms, parameters; and this rank's final shards."""
    g = torch.Generator().manual_seed(1234)
    batches = [models.TinyGPT.batch(g, 24) for _ in range(steps)]
    torch.manual_seed(0)
    reference = models.TinyGPT()
    start = copy.deepcopy(reference)
    ddp_norms: list[float] = []
    ddp_losses = train(DDP(reference), models.TinyGPT.loss, batches, rank, world, 2, 0.05, norms=ddp_norms)
    report = {}
    for defer in ("replicas", "all"):
        model = copy.deepcopy(start)
        runtime = shard_module(model, **policy)
        norms: list[float] = []
        losses = train(model, models.TinyGPT.loss, batches, rank, world, 2, 0.05, runtime=runtime, defer=defer,
                       norms=norms)
        full = full_state_dict(runtime, rank0_only=False)
        report[defer] = {
            "losses": losses, "norms": norms,
            "max_param_error": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
            "shards": [unit.storage.shard.clone() for unit in runtime.units],
        }
    return {"ddp_losses": ddp_losses, "ddp_norms": ddp_norms, **report}


def bytes_per_step(rank: int, world: int, policy: dict) -> dict:
    """``last_step_stats`` of a second step (the first records the order), one backward or two micro-batches."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    runtime = shard_module(model, **policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    stats = {}
    for name, micro_batches, skip in (("one_backward", 1, None), ("accumulate", 2, runtime.no_replica_sync),
                                      ("accumulate_no_sync", 2, runtime.no_sync)):
        for step in range(2):
            for i in range(micro_batches):
                last = i == micro_batches - 1
                with skip() if skip is not None and not last else nullcontext():
                    models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            runtime.after_optimizer_step()
        stats[name] = runtime.last_step_stats
    return {"stats": stats, "padded": {u.name: u.storage.padded_numel * 4 for u in runtime.units},
            "shard": {u.name: u.storage.shard_numel * 4 for u in runtime.units}, "last": runtime.order[-1].name}


def memory(rank: int, world: int, policy: dict) -> dict:
    """Bytes of parameters, gradients and AdamW state this rank holds after two steps."""
    torch.manual_seed(0)
    model = models.TinyGPT(d=16, n_blocks=4)
    unsharded = sum(p.numel() for p in model.parameters()) * 4
    runtime = shard_module(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), step).backward()
        opt.step()
    units = runtime.units
    return {
        "unsharded": unsharded, "units": len(units),
        "padded": sum(u.storage.padded_numel * 4 for u in units),
        "param": sum(u.storage.shard.numel() * 4 for u in units),
        "grad": sum(u.storage.shard_grad.numel() * 4 for u in units if u.storage.shard_grad is not None),
        "state": sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step"),
    }


def nonfinite_skipped_everywhere(rank: int, world: int, policy: dict) -> dict:
    """An infinite loss on the last rank only (another replica than rank 0's): every rank skips the step."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    runtime = shard_module(model, nonfinite="skip", **policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = full_state_dict(runtime, rank0_only=False)
    loss = models.TinyGPT.loss(model, models.TinyGPT.batch(torch.Generator().manual_seed(rank), 4), 0)
    with warnings.catch_warnings(record=True) as caught:  # (said before the optimizer step, which it skips)
        warnings.simplefilter("always")
        (loss * float("inf") if rank == world - 1 else loss).backward()
        opt.step()
    after = full_state_dict(runtime, rank0_only=False)
    return {"skipped": runtime.skipped_steps, "warned": any("skipped" in str(w.message) for w in caught),
            "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def load_under_full_and_hybrid(rank: int, world: int, path: str) -> dict:
    """The 4-rank hybrid checkpoint loaded on this world under full sharding, and under hybrid sharding with
    one-rank shard groups (every rank a replica)."""
    report = {name: checkpoint_scenarios.load_then_continue(rank, world, "gpt", policy, path)
              for name, policy in (("full", {"sharding": "full"}),
                                   ("hybrid", {"sharding": "hybrid", "shard_size": 1}))}
    dist.barrier()
    return report


def parity_only(rank: int, world: int, shard_size: int) -> dict:
    return parity(rank, world, {"sharding": "hybrid", "shard_size": shard_size}, steps=10)


def options_as_under_full(rank: int, world: int, shard_size: int, steps: int = 4) -> dict:
    """Under full, hybrid and none sharding: a model built on the meta device with bf16 gathers, fp32 reductions,
    prefetch 2 and activation checkpointing; and one whose embedding unit is fed token ids, with backward elision.
    Per setting and sharding: the initial and final values, the losses, the backward gathers skipped."""
    settings = {
        # the app's GPT: its reset_parameters() initialises it from the meta device
        "meta_bf16_checkpointed": (lambda: GPT(37, 16, 2, 2, 9), models.TinyGPT, True,
                                   {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "prefetch": 2,
                                    "activation_checkpointing": True}),
        "elided": (models.UntiedLM, models.UntiedLM, False,
                   {"units": ["Embedding", "Block"], "elide_backward_gathers": True}),
    }
    report = {}
    for name, (build, data, on_meta, options) in settings.items():
        g = torch.Generator().manual_seed(5)
        batches = [data.batch(g, 12) for _ in range(steps)]
        for sharding, extra in (("full", {}), ("hybrid", {"shard_size": shard_size}), ("none", {})):
            torch.manual_seed(0)
            with torch.device("meta") if on_meta else nullcontext():
                model = build()
            runtime = shard_module(model, sharding=sharding, device=torch.device("cpu"), **extra, **options)
            initial = full_state_dict(runtime, rank0_only=False)
            runtime.stats.skipped_gathers = 0
            losses = train(model, data.loss, batches, rank, world, runtime=runtime)
            report[name, sharding] = {"initial": initial, "losses": losses, "skipped": runtime.stats.skipped_gathers,
                                      "final": full_state_dict(runtime, rank0_only=False)}
    return report


def accumulation_habits(rank: int, world: int, policy: dict) -> dict:
    """Deferred all-reduce across replicas, against DDP's ``no_sync``: a ``zero_grad`` between micro-batches
    discards the earlier ones as under DDP, a gradient kept from the previous step (no ``zero_grad``) counts once,
    a last micro-batch whose backward fails and is run again keeps the earlier ones; a parameter frozen in the
    middle of the window keeps them (no error)."""
    g = torch.Generator().manual_seed(3)
    batches = [models.TinyGPT.batch(g, 4 * world) for _ in range(6)]
    torch.manual_seed(0)
    reference = models.TinyGPT()
    model = copy.deepcopy(reference)
    ddp = DDP(reference)
    runtime = shard_module(model, **policy)
    failed = []
    model.blocks[0].register_forward_hook(lambda m, a, out: _RaiseInBackward.apply(out))
    for net, skip in ((ddp, ddp.no_sync), (model, runtime.no_replica_sync)):
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        for step, window in enumerate((batches[:3], batches[3:])):
            for i, batch in enumerate(window):
                # the sharded model's last micro-batch of the second window fails once in backward on every rank,
                # after the later blocks took back their sums, and runs again: those sums must survive
                _RaiseInBackward.armed = net is model and step == 1 and i == 2
                if _RaiseInBackward.armed:
                    try:
                        models.TinyGPT.loss(net, batch.chunk(world)[rank], 0).backward()
                    except RuntimeError as err:
                        failed.append(str(err))
                    _RaiseInBackward.armed = False
                with skip() if i < 2 else nullcontext():
                    models.TinyGPT.loss(net, batch.chunk(world)[rank], 0).backward()
                if step == 0 and i == 0:
                    opt.zero_grad()  # the first micro-batch's gradients are dropped
            opt.step()  # the second window starts without zero_grad: the first's gradients count again
    full = full_state_dict(runtime, rank0_only=False)
    error = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    with runtime.no_replica_sync():
        models.TinyGPT.loss(model, batches[0].chunk(world)[rank], 0).backward()
    model.blocks[0].requires_grad_(False)
    try:
        models.TinyGPT.loss(model, batches[1].chunk(world)[rank], 0).backward()
        frozen = None
    except RuntimeError as err:
        frozen = str(err)
    return {"max_param_error": error, "frozen_error": frozen, "failed": failed}


class _RaiseInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _RaiseInBackward.armed:
            raise RuntimeError("a failing backward")
        return grad


def own_mesh(rank: int, world: int, shard_size: int) -> dict:
    """``shard_module(mesh=)`` with the user's own 2-D DeviceMesh trains as ``shard_size=`` does, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    g = torch.Generator().manual_seed(9)
    batches = [models.TinyGPT.batch(g, 12) for _ in range(3)]
    mesh = init_device_mesh("cpu", (world // shard_size, shard_size), mesh_dim_names=("dp_replicate", "dp_shard"))
    states = {}
    for name, policy in (("mesh", {"mesh": mesh}), ("shard_size", {"shard_size": shard_size})):
        torch.manual_seed(0)
        model = models.TinyGPT()
        runtime = shard_module(model, sharding="hybrid", **policy)
        train(model, models.TinyGPT.loss, batches, rank, world, runtime=runtime)
        states[name] = full_state_dict(runtime, rank0_only=False)
        if name == "mesh":  # sharded again (a second Trainer): the same groups go on, other ones are refused
            again = shard_module(model, sharding="hybrid", shard_size=shard_size) is runtime
            try:
                shard_module(model, sharding="hybrid", mesh=init_device_mesh("cpu", (world // shard_size, shard_size)))
                other_mesh = None
            except ValueError as err:
                other_mesh = str(err)
    return {"equal": all(torch.equal(states["mesh"][k], v) for k, v in states["shard_size"].items()),
            "groups": (runtime.groups.shard_size, runtime.groups.replicas), "again": again,
            "other_mesh_refused": "another mesh" in (other_mesh or "")}
