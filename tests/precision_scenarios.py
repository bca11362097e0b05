"""Precision scenarios run inside a gloo world (see world.py)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from lightning_shard.lightning.precision import ShardedGradScaler
from tests import models


def bf16_mixed_dtypes(rank: int, world: int):
    """One step of bf16-mixed: what each tensor's dtype is, and the bytes moved, next to fp32."""
    report = {}
    for name, param_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        model = models.TinyGPT()
        runtime = shard_module(model, param_dtype=param_dtype, reduce_dtype=torch.float32)
        seen = {}
        block = model.blocks[1]

        def note(key, value):  # hooks must return None
            seen.setdefault(key, value)

        block.register_forward_pre_hook(lambda m, a: note("gathered", m.ln1.weight.dtype))
        block.ln1.register_full_backward_hook(lambda m, gi, go: note("in_backward", m.weight.dtype))
        runtime.units[1].storage.gathered_params[0].register_post_accumulate_grad_hook(
            lambda p: note("unsharded_grad", p.grad.dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype is not None):
                loss = models.TinyGPT.loss(model, models.TinyGPT.batch(g, 4), step)
            loss.backward()
            seen["shard_grad"] = next(p.grad.dtype for p in model.parameters() if p.grad is not None)
            opt.step()
            runtime.after_optimizer_step()
        seen["master"] = {p.dtype for p in model.parameters()}
        seen["optimizer_state"] = {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
        seen["stats"] = runtime.last_step_stats
        seen["padded"] = {u.name: u.storage.padded_numel for u in runtime.units}
        seen["last"] = runtime.order[-1].name
        seen["loss"] = loss.item()
        report[name] = seen
    return report


def scaler_overflow_on_one_rank(rank: int, world: int):
    """fp16 training step where only the last rank's gradient shard overflows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    shard_module(model, param_dtype=torch.float16, reduce_dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    if rank == world - 1:
        next(p for p in model.parameters() if p.grad is not None and p.numel()).grad[0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"unchanged": unchanged, "scale": scaler.get_scale()}


class FloatInputNet(nn.Module):
    """Float inputs into a root-owned layer, then two block units (one called with keyword arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.blocks[0](h)
        h = h + self.blocks[1](input=h.float())  # an fp32 tensor into a bf16 unit, by keyword
        return self.head(h)


def _to_bf16(module, args, kwargs):
    cast = lambda x: x.bfloat16() if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
    return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}


def bf16_params_without_autocast(rank: int, world: int, steps: int = 4):
    """``param_dtype=bf16`` with autocast off: each unit casts its floating inputs to bf16 (FSDP2's
    cast_forward_inputs). Reference in one process: per rank's chunk, the bf16 copy of the fp32 masters run on the
    bf16 input, its bf16 gradients summed in fp32 and averaged, stepped on the fp32 masters."""
    import copy

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2 * world, 6, generator=g), torch.randn(2 * world, 1, generator=g)) for _ in range(steps)]
    torch.manual_seed(0)
    reference = FloatInputNet()
    model = copy.deepcopy(reference)
    runtime = shard_module(model, units=["Sequential"], param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches:
        grads = [torch.zeros_like(p) for p in reference.parameters()]
        for r in range(world):
            low = copy.deepcopy(reference).to(torch.bfloat16)
            for module in (low.inp, *low.blocks, low.head):  # what the units do, spelled out
                module.register_forward_pre_hook(_to_bf16, with_kwargs=True)
            xs, ys = x.chunk(world)[r], y.chunk(world)[r]
            nn.functional.mse_loss(low(xs.bfloat16()).float(), ys).backward()
            for acc, p in zip(grads, low.parameters()):
                acc.add_(p.grad.float() / world)
        for p, grad in zip(reference.parameters(), grads):
            p.grad = grad
        ref_opt.step()
        ref_opt.zero_grad()
        out = model(x.chunk(world)[rank])
        assert out.dtype == torch.bfloat16
        nn.functional.mse_loss(out.float(), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    from tests.exactness_scenarios import assert_matches

    assert_matches(runtime, reference, "bf16 params, no autocast")
    return True


class _LaterBranch(nn.Module):
    """``b`` is used from the second call on: its first gradient comes while ``a`` already has one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        return (self.b(y) if self.use_b else y).pow(2).sum()


def accumulation_with_create_graph(rank: int, world: int, create_graph: bool) -> dict[str, torch.Tensor]:
    """Two backwards at one rank computing in bf16, ``create_graph`` as given: the gradient shards they leave."""
    torch.manual_seed(0)
    model = _LaterBranch()
    shard_module(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    model(x).backward(create_graph=create_graph)
    model.use_b = True
    model(x).backward(create_graph=create_graph)
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(12, 12), nn.BatchNorm1d(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.linear(x)))


class BatchNormNet(nn.Module):
    """Blocks of Linear -> BatchNorm -> ReLU: under a unit policy, each batch norm lies inside a block's unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(6, 12), nn.Sequential(NormBlock(), NormBlock()), nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def batch_norm_under_bf16_autocast(rank: int, world: int, policy: dict, steps: int = 4):
    """bf16 gathers with the batch norms in units of their own, in fp32: under CPU autocast each takes the bf16
    activations with its fp32 weights and statistics, as without sharding (bf16 weights beside fp32 statistics were
    torch's "expected scalar type BFloat16 but found Float"); inside checkpointed blocks too, whose recomputation
    gathers them. Reference: DDP's numbers spelled out in one process, each rank's chunk through a copy under
    autocast, the gradients averaged, rank 0's statistics kept. Checkpointed, the statistics are left out: recomputed
    in train mode, a batch norm updates them twice, as under torch's checkpoint without sharding (batch statistics,
    not running ones, are what a training step computes with, so the weights still match)."""
    import copy

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 1, generator=g)) for _ in range(steps)]
    torch.manual_seed(0)
    reference = BatchNormNet()
    model = copy.deepcopy(reference)
    runtime = shard_module(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **policy)
    norms = [u for u in runtime.units if isinstance(u.members[0], nn.BatchNorm1d)]  # nested in the blocks' units
    assert len(norms) == 2 and all(u.storage.param_dtype == torch.float32 for u in norms)
    assert all(u.storage.param_dtype == torch.bfloat16 for u in runtime.units if u not in norms)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    for x, y in batches:
        copies = [copy.deepcopy(reference) for _ in range(world)]
        for r, replica in enumerate(copies):
            with autocast:
                out = replica(x.chunk(world)[r])
            nn.functional.mse_loss(out.float(), y.chunk(world)[r]).backward()
        for p, *replicas in zip(reference.parameters(), *(c.parameters() for c in copies)):
            p.grad = sum(q.grad for q in replicas) / world
        for b, b0 in zip(reference.buffers(), copies[0].buffers()):
            b.copy_(b0)
        ref_opt.step()
        ref_opt.zero_grad()
        runtime.sync_buffers()  # a step's start makes them rank 0's (broadcast_buffers)
        with autocast:
            out = model(x.chunk(world)[rank])
        nn.functional.mse_loss(out.float(), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    from lightning_shard.checkpoint.full import full_state_dict

    full = full_state_dict(runtime, rank0_only=False)
    checkpointed = bool(policy.get("activation_checkpointing"))
    for name, value in reference.state_dict().items():
        if not (checkpointed and ("running" in name or "num_batches" in name)):
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return True


def bf16_no_sync_accumulation(rank: int, world: int, shardings: list[str], micro: int = 4, steps: int = 3) -> list:
    """bf16 compute, fp32 masters and reduction, ``micro`` micro-batches per step of which all but the last under
    ``no_sync()``. DDP under bf16-mixed (and FSDP2) sums the micro-batches' bf16 gradients in fp32: the reference, one
    process, sums each rank's and micro-batch's bf16 gradient in fp32 and averages over ranks; Adam on the fp32
    masters. Returns the largest difference relative to each parameter's scale."""
    import copy

    worst = []
    for sharding in shardings:
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.Tanh()), nn.Sequential(nn.Linear(32, 32),
                                  nn.Tanh()), nn.Linear(32, 1))
        model = copy.deepcopy(reference)
        runtime = shard_module(model, sharding=sharding, units=["Sequential"], param_dtype=torch.bfloat16,
                               reduce_dtype=torch.float32)
        opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            xs = [torch.randn(2 * world, 16, generator=g) for _ in range(micro)]
            for p in reference.parameters():
                p.grad = torch.zeros_like(p)
            for x in xs:
                for r in range(world):
                    low = copy.deepcopy(reference).bfloat16()
                    low(x.chunk(world)[r].bfloat16()).float().pow(2).mean().backward()
                    for p, q in zip(reference.parameters(), low.parameters()):
                        p.grad.add_(q.grad.float() / world)
            for i, x in enumerate(xs):
                loss = lambda: model(x.chunk(world)[rank]).float().pow(2).mean()  # noqa: E731
                if i < micro - 1:
                    with runtime.no_sync():
                        runtime.run_step(loss).backward()
                else:
                    runtime.run_step(loss).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            runtime.after_optimizer_step()
        full = full_state_dict(runtime, rank0_only=False)
        worst.append(max(float((full[n] - p).abs().max() / p.abs().max()) for n, p in reference.state_dict().items()))
    return worst
