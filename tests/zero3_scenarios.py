"""DeepSpeed ZeRO-3's own test habits (``tests/unit/runtime/zero/test_zero*.py``) against the engine, run inside a gloo
world (see world.py), each against DDP or one process on the same global batch: a unit returning its own parameter
(Megatron's ``(output, self.bias)``), a parent reading a child unit's parameter ("external parameters"), parameters
frozen between micro-batches, writes inside ``keep_gathered()`` (``GatheredParameters``' ``modifier_rank``), and what
is refused at setup (sharding twice, an optimizer holding tensors outside the model, an uninitialised lazy module)."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_shard.engine.shard_module import shard_module
from tests.exactness_scenarios import assert_matches


def _batches(world: int, steps: int, width: int = 6, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4 * world, width, generator=g), torch.randn(4 * world, 1, generator=g)) for _ in range(steps)]


def _against_ddp(rank: int, world: int, build, policy: dict, steps: int = 4, loss=None) -> tuple[nn.Module, nn.Module]:
    """Train ``build()`` sharded with ``policy`` and under DDP on the same batches; assert the same final weights.
    Returns both models."""
    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    ddp = DDP(reference)
    runtime = shard_module(model, **policy)
    loss = loss or (lambda net, x, y: nn.functional.mse_loss(net(x), y))
    for net in (ddp, model):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        if net is model:
            runtime.attach_optimizer(opt)
        for x, y in _batches(world, steps):
            loss(net, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            if net is model:
                runtime.step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
    assert_matches(runtime, reference, str(policy))
    return model, reference


# -- a unit that returns its own parameter --------------------------------------------------------------------------
class LinearWrapper(nn.Module):
    """Megatron's ColumnParallelLinear with ``skip_bias_add``: the bias is returned for the caller to fuse."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return self.linear(x), self.bias


class FusedBias(nn.Module):
    """The caller adds the returned bias (nothing saved) in one layer and multiplies by it (saved for backward) in
    the next; the last returned bias is kept beyond the step and read after backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.head = LinearWrapper(6, 10), LinearWrapper(10, 7), nn.Linear(7, 1)
        self.__dict__["kept"] = None

    def forward(self, x):
        h, bias = self.first(x)
        h, scale = self.second(torch.tanh(h + bias))
        self.__dict__["kept"] = scale  # (not registered: under DDP it is the parameter itself)
        self.__dict__["value_kept"] = scale.detach().clone()
        return self.head(torch.tanh(h * scale))


class Holder:
    """DeepSpeed's test_ext_param_returnobj: a plain class (no dataclass, no pytree node) wrapping what a unit returns."""

    def __init__(self, out=None, bias=None) -> None:
        self.out, self.bias = out, bias


class ReturnsObject(LinearWrapper):
    def forward(self, x):
        return Holder(out=self.linear(x), bias=self.bias)


class FusedObjectBias(FusedBias):
    """FusedBias's units returning their output and bias inside a :class:`Holder` (both ranks died of a segfault:
    the bias inside was a view of the freed gathered buffer, and the output's backward was unseen)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = ReturnsObject(6, 10), ReturnsObject(10, 7)

    def forward(self, x):
        first = self.first(x)
        second = self.second(torch.tanh(first.out + first.bias))
        return self.head(torch.tanh(second.out * second.bias))


def returns_own_parameter(rank: int, world: int) -> bool:
    """Against DDP, each unit freed after its forward (``full``) or after its backward (``grad_op``); the returned bias
    kept by the module is readable after the step, holding what the last forward returned (it read freed memory: a
    segfault)."""
    for sharding in ("full", "grad_op"):
        model, reference = _against_ddp(rank, world, FusedBias, {"sharding": sharding, "units": ["LinearWrapper"]})
        torch.testing.assert_close(model.kept.detach(), reference.value_kept, rtol=1e-5, atol=1e-6)
        _against_ddp(rank, world, FusedObjectBias, {"sharding": sharding, "units": ["ReturnsObject"]})
    return True


# -- a parent reading a child unit's parameter ----------------------------------------------------------------------
class ExternalReads(nn.Module):
    """DeepSpeed's external parameters: the parent reads ``linear1.weight`` after linear1 ran (freed under ``full``)
    and ``linear2.weight`` before linear2 runs (not gathered yet). Sizes whose 1-D shards broadcast with nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.linear1(x))
        h = h + 0.1 * (x @ self.linear1.weight.t())  # after linear1 ran
        h = h + 0.1 * torch.tanh(h @ self.linear2.weight)  # before linear2 runs
        return self.head(torch.tanh(self.linear2(h)))


def external_parameters(rank: int, world: int) -> dict:
    """Against DDP under every sharding; and what a read costs: the unit gathered again, kept to the end of backward."""
    out = {}
    for sharding in ("full", "grad_op", "none"):
        model, _ = _against_ddp(rank, world, ExternalReads, {"sharding": sharding, "units": ["Linear"]})
        out[sharding] = model._shard_runtime.last_step_stats
    return out


# -- requires_grad changed between micro-batches -------------------------------------------------------------------
class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 1))

    def forward(self, x):
        return self.linears(x)


def _accumulate_with_freezing(rank: int, world: int, policy: dict, deferral: str, freeze: str) -> None:
    """Three micro-batches per step: the biases train in the first, are frozen for the second (``freeze="biases"``)
    or the whole first layer is (``"layer"``), and unfrozen after the step. Plain torch keeps and steps the gradients
    the frozen parameters got before; so must the engine, whatever it defers (``deferral``: ``"all"`` is
    ``no_sync``, ``"replicas"`` is ``no_replica_sync``, ``""`` reduces every micro-batch). Reference: one process on
    the global micro-batches."""
    torch.manual_seed(0)
    reference = TwoLinears()
    model = copy.deepcopy(reference)
    runtime = shard_module(model, units=["Linear"], **policy)
    g = torch.Generator().manual_seed(1)
    windows = [[(torch.randn(2 * world, 6, generator=g), torch.randn(2 * world, 1, generator=g)) for _ in range(3)]
               for _ in range(3)]
    for net in (reference, model):
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        if net is model:
            runtime.attach_optimizer(opt)
        frozen = [net.linears[0].bias, net.linears[2].bias] if freeze == "biases" else list(net.linears[0].parameters())
        for window in windows:
            for i, (x, y) in enumerate(window):
                if i == 1:
                    for p in frozen:
                        p.requires_grad_(False)
                skip = {"all": runtime.no_sync, "replicas": runtime.no_replica_sync}.get(deferral)
                last = i == len(window) - 1
                with skip() if net is model and skip is not None and not last else nullcontext():
                    if net is model:
                        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
                    (nn.functional.mse_loss(net(x), y) / len(window)).backward()
            if net is model:
                runtime.step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            for p in frozen:
                p.requires_grad_(True)
    assert_matches(runtime, reference, f"{policy} {deferral} {freeze}")


def frozen_between_micro_batches(rank: int, world: int) -> bool:
    for policy in ({"sharding": "full"}, {"sharding": "grad_op"}, {"sharding": "hybrid", "shard_size": 1},
                   {"sharding": "none"}):
        for deferral in ("all", "replicas", ""):
            for freeze in ("biases", "layer"):
                _accumulate_with_freezing(rank, world, policy, deferral, freeze)
    return True


# -- keep_gathered() and writes ------------------------------------------------------------------------------------
def writes_inside_keep_gathered(rank: int, world: int) -> dict:
    """A write inside ``keep_gathered()``: refused on every rank, naming the parameter, unless a ``modifier_rank`` is
    given, whose values are then kept (its write, on every rank), exactly as the plain model with the same write;
    computing in bf16 the elements not written keep their fp32 masters. Training goes on like DDP."""
    out = {}
    torch.manual_seed(0)
    plain = TwoLinears()
    model = copy.deepcopy(plain)
    runtime = shard_module(model, units=["Linear"])
    try:
        with runtime.keep_gathered(), torch.no_grad():
            model.linears[0].weight[1, 2] += 0.5 if rank == 1 else 0.0  # (a write on one rank is a write)
    except RuntimeError as err:
        out["refused"] = str(err)
    try:  # through .data, which no version counter sees: the rank that owns the element sees it in its part
        with runtime.keep_gathered():
            model.linears[2].bias.data.fill_(0.5)
    except RuntimeError as err:
        out["refused_data_write"] = str(err)
    assert_matches(runtime, plain, "a refused write changes nothing")
    out["bad_rank"] = _error(lambda: runtime.keep_gathered(modifier_rank=world).__enter__())
    with runtime.keep_gathered(modifier_rank=1), torch.no_grad():  # rank 1's values kept, whatever rank 0 writes
        model.linears[0].weight.mul_(2.0 if rank == 1 else 3.0)
        model.linears[2].bias.fill_(0.25)
    with torch.no_grad():
        plain.linears[0].weight.mul_(2.0)
        plain.linears[2].bias.fill_(0.25)
    assert_matches(runtime, plain, "written back from rank 1")
    # bf16 gathers: an element written gets the bf16 value written, the others keep their fp32 masters
    low = copy.deepcopy(plain)
    low_runtime = shard_module(low, units=["Linear"], param_dtype=torch.bfloat16)
    with low_runtime.keep_gathered(modifier_rank=0), torch.no_grad():
        low.linears[2].weight[0, 3] = 1.5
    expected = copy.deepcopy(plain)
    with torch.no_grad():
        expected.linears[2].weight[0, 3] = 1.5
    full = {k: v for k, v in _full(low_runtime).items()}
    out["bf16_exact"] = all(torch.equal(full[k], v) for k, v in expected.state_dict().items())
    # and training goes on like DDP from the weights written
    ddp = DDP(copy.deepcopy(plain))
    for net in (ddp, model):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if net is model:
            runtime.attach_optimizer(opt)
        for x, y in _batches(world, 3, seed=7):
            nn.functional.mse_loss(net(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            runtime.step(opt) if net is model else opt.step()
            opt.zero_grad()
    assert_matches(runtime, ddp.module, "training after the write")
    return out


def _full(runtime) -> dict:
    from lightning_shard.checkpoint.full import full_state_dict

    return full_state_dict(runtime, rank0_only=False)


# -- refused at setup ----------------------------------------------------------------------------------------------
def _error(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


class Stack(nn.Module):
    def __init__(self, inner: nn.Module = None) -> None:
        super().__init__()
        self.inner = inner if inner is not None else nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5))
        self.head = nn.Linear(5, 1)

    def forward(self, x):
        return self.head(self.inner(x))


def refused_at_setup(rank: int, world: int) -> dict:
    """Each refused before any collective, on every rank, naming what to change; then a collective proves that no
    rank is left waiting in one."""
    out = {}
    nested = Stack()
    shard_module(nested.inner)
    out["nested"] = _error(lambda: shard_module(nested))
    first = Stack()
    shard_module(first)
    out["shared"] = _error(lambda: shard_module(Stack(first.inner)))
    lazy = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 1))
    out["lazy"] = _error(lambda: shard_module(lazy))
    model = Stack()
    runtime = shard_module(model, units=["Linear"])
    model.extra = nn.Linear(5, 5)  # added after sharding: trained with each rank's own gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["added"] = _error(lambda: runtime.attach_optimizer(opt))
    other = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p for p in model.parameters() if p is not model.extra.weight and p is not model.extra.bias],
                          lr=0.1)
    runtime.attach_optimizer(opt)
    opt.add_param_group({"params": [other]})  # a group added later (as fine-tuning callbacks do)
    model(torch.randn(2, 6)).sum().backward()
    out["added_group"] = _error(lambda: runtime.step(opt))
    dist.barrier()
    return out


def consolidate_on_one_rank(rank: int, world: int, directory: str) -> dict:
    """A sharded checkpoint saved by both ranks, then consolidated on rank 0 alone while rank 1 waits in a barrier
    (the default group exists: what a job's rank 0 sees). Returns rank 0's consolidated model state."""
    from pathlib import Path

    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.consolidate import consolidate
    from lightning_shard.checkpoint.io import save_sharded

    torch.manual_seed(0)
    model = Stack()
    runtime = shard_module(model, units=["Linear"])
    path = Path(directory) / "model.ckpt"
    save_sharded({"state_dict": sharded.model_state(runtime), "epoch": 0}, path)
    state = consolidate(path)["state_dict"] if rank == 0 else None
    dist.barrier()
    return state
