"""Scenarios for "exact or loud" (run inside a gloo world, see world.py): habits of real models that make
ranks see different things, each trained against DDP or a single process on the same global batch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module


def in_modes(rank: int, world: int, scenario, modes: list[str]) -> list:
    """One world for several shardings of a scenario: a world's start costs more than most scenarios."""
    return [scenario(rank, world, mode) for mode in modes]


def assert_matches(runtime, reference: nn.Module, tag: str) -> None:
    """The sharded model's full state equals the reference's, to float32 rounding."""
    full = full_state_dict(runtime, rank0_only=False)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"[{tag}] {n}: {m}")


class Block(nn.Module):
    """``b`` runs only on a rank whose data says so (its elements are owned by the last rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h, flag):
        h = self.a(h)
        return h + self.b(h) if flag else h


class Gate(nn.Module):
    """The whole unit's parameters are used (and saved for backward) only on a rank whose data says so."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, flag):
        return torch.tanh(self.lin(h)) if flag else h


class Experts(nn.Module):
    """Top-1 routed experts inside one unit: an expert gets no token on some ranks, or on none."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(8, n)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, h, flag):
        probs = self.router(h).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if len(rows):
                out = out.index_add(0, rows, expert(h[rows]) * probs[rows, e : e + 1])
        return h + out


class BranchyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.block, self.gate, self.moe = nn.Linear(8, 8), Block(), Gate(), Experts()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        flag = bool(x[:, 0].mean() > 0)  # each rank's own data decides
        h = self.stem(x)
        h = self.moe(self.gate(self.block(h, flag), flag), flag)
        return self.head(h)

    @staticmethod
    def batch(g: torch.Generator, world: int):
        x = torch.randn(3 * world, 8, generator=g)
        x[:3, 0] = x[:3, 0].abs() + 0.5  # rank 0 takes the branches, the others do not
        x[3:, 0] = -x[3:, 0].abs() - 0.5
        return x, torch.randn(3 * world, 1, generator=g)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # decay tells grad=None from zero


def branches(rank: int, world: int, mode: str, elide: bool, steps: int = 5):
    g = torch.Generator().manual_seed(7)
    batches = [BranchyNet.batch(g, world) for _ in range(steps)]
    torch.manual_seed(0)
    reference = BranchyNet()
    sharded = copy.deepcopy(reference)
    ddp = DDP(reference, find_unused_parameters=True)
    runtime = shard_module(sharded, sharding=mode, units=["Block", "Gate", "Experts"], elide_backward_gathers=elide)
    for model in (ddp, sharded):
        opt = _adamw(model)
        for x, y in batches:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert_matches(runtime, reference, f"{mode}, elide={elide}")
    never_used = [n for n, p in reference.named_parameters() if p.grad is None and n.startswith("moe.experts")]
    return {"units": [u.name for u in runtime.units], "never_used_experts": never_used}


class Boom(torch.autograd.Function):
    """Identity whose backward raises, as an out-of-memory inside backward would."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 1)
        self.explode = False

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.explode and i == 1:
                x = Boom.apply(x)
        return self.head(x)


def failed_backward(rank: int, world: int, mode: str, steps: int = 5, fail_at: int = 2):
    """A step whose backward raises is skipped by the user; the next steps train exactly as if it never ran."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 1, generator=g)) for _ in range(steps)]
    torch.manual_seed(0)
    reference = Chain()
    sharded = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(batches):  # one process on the global batch, the failed step left out
        if step != fail_at:
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    runtime = shard_module(sharded, sharding=mode, units=["Sequential"])
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9)
    failures = 0
    for step, (x, y) in enumerate(batches):
        sharded.explode = step == fail_at
        try:
            nn.functional.mse_loss(sharded(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        except RuntimeError as err:
            assert "boom" in str(err)
            failures += 1
            opt.zero_grad(set_to_none=True)
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_matches(runtime, reference, mode)
    return failures


class InPlace(nn.Module):
    """Changes in place a tensor autograd saved, inside the step (where elision's hook would be active)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        z = self.b(self.a(x)).exp()
        z.mul_(0)
        return z


def inplace_on_saved(rank: int, world: int):
    """Autograd's in-place check still fires under the default options, as without sharding."""
    model = InPlace()
    shard_module(model, units=["Linear"])
    try:
        model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as err:
        return "modified by an inplace operation" in str(err)
    return False


class SparseMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return torch.sparse.mm(torch.eye(4).to_sparse().requires_grad_(), self.a(x))  # saves a sparse tensor


def sparse_saved_tensor(rank: int, world: int):
    """A sparse tensor saved for backward inside the step, with elision on."""
    model = SparseMix()
    shard_module(model, units=["Linear"], elide_backward_gathers=True)
    model(torch.randn(4, 4)).sum().backward()
    return model.a.weight.grad is not None


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.block, self.head = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1)

    def forward(self, x):
        h = self.block(self.block(self.stem(x)))  # one unit called twice
        return self.head(h), h


class TwiceThroughRoot(Twice):
    """The second backward needs a weight of the root unit (``mix``'s, for its input's gradient), which the end of the
    first backward freed."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)

    def forward(self, x):
        h = self.block(self.block(self.mix(self.stem(x))))
        return self.head(h), h


def two_backwards(rank: int, world: int, mode: str, through_root: bool = False):
    """Two backward passes through one graph (retain_graph), a unit called twice: the gradients DDP means
    (the ranks' gradients averaged), computed in one process over every rank's chunk as the reference."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * world, 4, generator=g)
    torch.manual_seed(0)
    reference = TwiceThroughRoot() if through_root else Twice()
    sharded = copy.deepcopy(reference)
    runtime = shard_module(sharded, sharding=mode, units=["Sequential"])
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.5)
    for _ in range(2):
        for chunk in x.chunk(world):
            out, h = reference(chunk)
            out.sum().backward(retain_graph=True)
            h.pow(2).sum().backward()
        for p in reference.parameters():
            p.grad /= world
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out, h = sharded(x.chunk(world)[rank])
        out.sum().backward(retain_graph=True)
        h.pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_matches(runtime, reference, mode)
    return True


class AuxOnSomeRanks(nn.Module):
    """An auxiliary head whose loss term only some ranks' data adds: its backward runs on those ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head, self.aux = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)  # equal sizes

    def forward(self, x):
        h = self.trunk(x)
        loss, aux = self.head(h).sum(), self.aux(h).sum()
        return loss + aux if x[:, 0].mean() > 0 else loss


def aux_on_some_ranks(rank: int, world: int):
    model = AuxOnSomeRanks()
    shard_module(model, sharding="grad_op", units=["Linear"])  # no backward gathers: only the reductions differ
    x = torch.randn(4, 8)
    x[:, 0] = x[:, 0].abs() + 0.5 if rank == 0 else -x[:, 0].abs() - 0.5
    model(x).backward()


def gradient_norms(rank: int, world: int):
    """The runtime's per-parameter and total gradient norms (p = 1, 2, 3, inf) and its clipping, under each
    sharding, against Lightning's ``grad_norm`` and torch's ``clip_grad_norm_`` in one process on the global
    batch: TinyGPT (a tied head, a bare parameter) with a frozen block (no gradient) as units."""
    from lightning.pytorch.utilities import grad_norm

    from tests.models import TinyGPT

    batch = TinyGPT.batch(torch.Generator().manual_seed(3), 4 * world)
    torch.manual_seed(0)
    reference = TinyGPT()
    reference.blocks[1].requires_grad_(False)
    TinyGPT.loss(reference, batch, 0).backward()
    for mode in ("full", "grad_op", "none"):
        sharded = copy.deepcopy(reference)
        runtime = shard_module(sharded, sharding=mode, units=["Block"])
        TinyGPT.loss(sharded, batch.chunk(world)[rank], 0).backward()
        for p in (1, 2, 3, float("inf")):
            expected = grad_norm(reference, p)
            names, each, total = runtime.grad_norms(p)
            got = {f"grad_{float(p)}_norm/{n}": v for n, v in zip(names, each)}
            got[f"grad_{float(p)}_norm_total"] = total
            assert list(got) == list(expected), (mode, p, list(got), list(expected))
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{mode} {k}: {m}")
        clipped = copy.deepcopy(reference)
        for q, r in zip(clipped.parameters(), reference.parameters()):
            q.grad = None if r.grad is None else r.grad.clone()  # a deepcopied Parameter has none
        expected_norm = torch.nn.utils.clip_grad_norm_(clipped.parameters(), 0.1, norm_type=3.0)
        norm = runtime.clip_grad_norm_(list(sharded.parameters()), 0.1, norm_type=3.0)
        torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0)
        for module in (sharded, clipped):  # compare the clipped gradients through one SGD step
            torch.optim.SGD([q for q in module.parameters() if q.requires_grad], lr=1.0).step()
        assert_matches(runtime, clipped, mode)
    return True


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        return torch.relu(self.norm(self.lin(x)))


def buffers_like_ddp(rank: int, world: int, steps: int = 4):
    """BatchNorm running statistics under DDP(broadcast_buffers=True), compared on every rank (each sees its own
    data): after training, after an eval forward, and in the checkpoints, which hold rank 0's copy."""
    from lightning_shard.checkpoint import sharded as sharded_checkpoint

    g = torch.Generator().manual_seed(9)
    data = [torch.randn(world, 4, 6, generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    reference = nn.Sequential(NormBlock(), NormBlock(), nn.Linear(6, 1))
    model = copy.deepcopy(reference)
    ddp = DDP(reference)
    runtime = shard_module(model, units=["NormBlock"])
    for module in (ddp, model):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for x in data:
            module(x[rank] * (rank + 1)).square().mean().backward()  # ranks' statistics differ
            opt.step()
            opt.zero_grad()
    live = {k: v.clone() for k, v in model.named_buffers()}
    for name, value in reference.named_buffers():  # this rank's own, as DDP leaves them
        torch.testing.assert_close(live[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
    ddp.eval(), model.eval()
    with torch.no_grad():
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
        torch.testing.assert_close(model(x), ddp(x), rtol=1e-5, atol=1e-6)  # rank 0's statistics, everywhere
    model.train()
    for save in (lambda: full_state_dict(runtime, rank0_only=False), lambda: sharded_checkpoint.model_state(runtime)):
        model(data[0][rank] * (rank + 1)).sum().backward()  # leaves each rank its own buffers again
        rank0 = {k: v.clone() for k, v in model.named_buffers()}
        for value in rank0.values():
            dist.broadcast(value, src=0)
        state = save()
        for name, value in rank0.items():  # the checkpoint holds rank 0's copy, on every rank
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"saved {n}: {m}")
    return sorted(live)


def side_forward_on_rank_0(rank: int, world: int):
    """``if self.global_rank == 0: self(x)`` (a sample in a callback, outside the steps) with ``sharding="none"``,
    which gathers nothing: it must run no collective (DDP's plain module forward does not), or rank 0 would hang
    in it alone. Steps go through ``run_step``, as the strategy drives them."""
    model = nn.Sequential(NormBlock(), nn.Linear(6, 1))
    runtime = shard_module(model, sharding="none", units=["NormBlock"])

    def train(x):
        model(x).square().mean().backward()

    for _ in range(2):
        runtime.run_step(train, torch.randn(4, 6))
        if rank == 0:
            with torch.enable_grad():
                model(torch.randn(3, 6))
    runtime.run_step(train, torch.randn(4, 6))
    return runtime.stats.agreements > 0
