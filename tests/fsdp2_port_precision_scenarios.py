"""FSDP2's mixed precision scenarios (pytorch test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py)
on our engine's ``param_dtype``, ``reduce_dtype`` and ``buffer_dtype``, each against one process that computes the
same way, as FSDP2's own reference does: fp32 masters stepped by AdamW, a copy of them in ``param_dtype`` (buffers
in ``buffer_dtype``) run on each rank's chunk in turn, each chunk's micro-batches summed in the wider of the compute
and the reduction dtype (DDP sums them in its fp32 ``.grad``; FSDP2 in the unsharded gradient), then cast to
``reduce_dtype``, divided by the world size and summed in rank order in ``reduce_dtype`` (the engine divides first,
then reduce-scatters; at 2 ranks the sum of two terms is the same in any order). The same operations on the same
values: exact (rtol 0, atol 0) unless a scenario says why not."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests.fsdp2_port_common import MLP, Side, adamw, assert_same_grads


class MixedSide(Side):
    """``backward(loss)``: the reference's also moves each backward's gradients into its rank's sum (``flush``)."""

    def __init__(self, runtime=None, rank: int = 0, world: int = 1, flush: Optional[Callable] = None) -> None:
        super().__init__(runtime, rank, world)
        self.flush = flush

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.flush is not None:
            self.flush()


def _wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps <= torch.finfo(b).eps else b


def compare_mixed(rank: int, world: int, build: Callable[[], nn.Module], step: Callable, tag: str, steps: int = 4,
                  rows: int = 2, dim: int = 8, mode: str = "full", param_dtype: Optional[torch.dtype] = None,
                  reduce_dtype: Optional[torch.dtype] = None, buffer_dtype: Optional[torch.dtype] = None,
                  before_step: Optional[Callable] = None, rtol: float = 0.0, atol: float = 0.0,
                  cast_inputs_of: tuple = (), **shard_kwargs: Any) -> None:
    """As fsdp2_port_common.compare, ``step(model, x, i, side)`` calling ``side.backward(loss)``; the reference
    computes in a copy cast as the engine gathers (module docstring), the floating inputs of its modules of the
    classes ``cast_inputs_of`` (the units) cast to ``param_dtype`` as the engine casts each unit's."""
    g = torch.Generator().manual_seed(11)
    batches = [torch.randn(rows * world, dim, generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    master = build()
    sharded = copy.deepcopy(master)
    compute = copy.deepcopy(master)
    for p in compute.parameters():
        if param_dtype is not None and p.is_floating_point():
            p.data = p.data.to(param_dtype)
    for module in compute.modules():
        for name, buffer in module._buffers.items():
            if buffer_dtype is not None and buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(buffer_dtype)
    for module in compute.modules():
        if isinstance(module, cast_inputs_of):
            module.register_forward_pre_hook(lambda m, args: tuple(
                a.to(param_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    runtime = shard_module(sharded, sharding=mode, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           buffer_dtype=buffer_dtype, **shard_kwargs)
    ref_opt, opt = adamw(master), adamw(sharded)
    pairs = [(mp, cp) for mp, cp in zip(master.parameters(), compute.parameters())]
    summed: dict[int, torch.Tensor] = {}

    def flush() -> None:  # one rank's micro-batches, summed in the wider of compute and reduce dtype
        for mp, cp in pairs:
            if cp.grad is not None:
                wide = _wider(cp.dtype, reduce_dtype or mp.dtype)
                summed[id(cp)] = summed[id(cp)] + cp.grad.to(wide) if id(cp) in summed else cp.grad.to(wide)
                cp.grad = None

    for i, batch in enumerate(batches):
        set_to_none = i % 2 == 0
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        if before_step is not None:
            for model in (master, compute, sharded):
                before_step(model, i)
        reduced: dict[int, torch.Tensor] = {}
        ref_loss = 0.0
        for chunk in batch.chunk(world):
            x = chunk.to(param_dtype) if param_dtype is not None else chunk
            ref_loss = ref_loss + step(compute, x, i, MixedSide(flush=flush)).detach().float()
            for mp, cp in pairs:  # this rank's sum, cast to the reduction's dtype and divided, then added
                if id(cp) in summed:
                    part = summed.pop(id(cp)).to(reduce_dtype or mp.dtype) / world
                    reduced[id(mp)] = reduced[id(mp)] + part if id(mp) in reduced else part
        for mp, _ in pairs:
            if id(mp) in reduced:
                grad = reduced[id(mp)].to(mp.dtype)
                mp.grad = grad if mp.grad is None else mp.grad + grad
        loss = step(sharded, batch.chunk(world)[rank], i, MixedSide(runtime, rank, world)).detach().float()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=lambda m: f"[{tag}] step {i} loss: {m}")
        has = [n for n, p in sharded.named_parameters() if p.grad is not None]
        expected = [n for n, p in master.named_parameters() if p.grad is not None]
        assert has == expected, f"[{tag}] step {i}: gradients on {has}, the reference's on {expected}"
        for n, p in sharded.named_parameters():
            if p.grad is not None:
                assert p.grad.dtype == p.dtype, f"[{tag}] gradient of {n} in {p.grad.dtype}, its master in {p.dtype}"
        assert_same_grads(sharded, master, f"{tag}] step {i}", rtol=rtol, atol=atol)
        ref_opt.step()
        opt.step()
        with torch.no_grad():
            for mp, cp in pairs:
                cp.copy_(mp)
    full = full_state_dict(runtime, rank0_only=False)
    expected_state = {**compute.state_dict(), **dict(master.named_parameters())}
    for name, value in expected_state.items():
        assert full[name].dtype == value.dtype, f"[{tag}] {name} in {full[name].dtype}, expected {value.dtype}"
        torch.testing.assert_close(full[name], value.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"[{tag}] {n}: {m}")


def _stack() -> nn.Module:
    return nn.Sequential(*(MLP() for _ in range(3)))


def _plain(dtype: Optional[torch.dtype] = None) -> Callable:
    """One forward and backward; the output in ``dtype`` (FSDP2's outputs stay in param_dtype)."""
    def step(model, x, i, side):
        out = model(x)
        if dtype is not None:
            assert out.dtype == dtype, f"output in {out.dtype}, expected {dtype}"
        loss = out.sum()
        side.backward(loss)
        return loss
    return step


def compute_dtype(rank: int, world: int, mode: str, dtype: torch.dtype, reduce_dtype: Optional[torch.dtype]) -> None:
    """test_compute_dtype (reduce_dtype None: fp32, the masters') and test_reduce_dtype's fp32 reduction: three MLP
    units and the root computing in ``dtype``, their outputs in ``dtype``."""
    compare_mixed(rank, world, _stack, _plain(dtype), f"compute/{dtype}/{reduce_dtype}/{mode}", mode=mode,
                  param_dtype=dtype, reduce_dtype=reduce_dtype, units=["MLP"])


def bf16_reduce(rank: int, world: int, mode: str) -> None:
    """test_reduce_dtype's bf16 reduction: fp32 compute, gradients reduced in bf16, the masters' in fp32."""
    compare_mixed(rank, world, _stack, _plain(torch.float32), f"bf16_reduce/{mode}", mode=mode,
                  reduce_dtype=torch.bfloat16, units=["MLP"])


def accumulation(rank: int, world: int, mode: str, param_dtype: Optional[torch.dtype],
                 reduce_dtype: torch.dtype) -> None:
    """test_grad_acc_with_reduce_dtype: four micro-batches, all but the last under no_sync, summed in the wider of
    the compute and the reduction dtype (FSDP2 accumulates the unsharded gradient so; DDP in fp32 .grad)."""
    def step(model, x, i, side):
        total = 0.0
        for m, mb in enumerate(x.chunk(4)):
            with side.no_sync() if m < 3 else torch.enable_grad():
                loss = model(mb).sum()
                side.backward(loss)
            total = total + loss.detach().float()
        return total

    compare_mixed(rank, world, _stack, step, f"accumulation/{param_dtype}/{reduce_dtype}/{mode}", rows=8, mode=mode,
                  param_dtype=param_dtype, reduce_dtype=reduce_dtype, units=["MLP"])


class WithFrozenInteger(nn.Module):
    """test_reduce_dtype_after_frozen_first_forward's Model: two linears and an int64 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.non_float = nn.Parameter(torch.ones(8, dtype=torch.int64), requires_grad=False)

    def forward(self, x):
        return self.layers(x)


def frozen_first_forward(rank: int, world: int, mode: str) -> None:
    """test_reduce_dtype_after_frozen_first_forward: all frozen and a no_grad forward first, then the linears
    unfrozen: their gradients in fp32, reduced in fp32."""
    def freeze(model, i):
        model.requires_grad_(False)
        model.layers.requires_grad_(i > 0)

    def step(model, x, i, side):
        if i == 0:
            with torch.no_grad():
                return model(x).sum()
        return _plain(torch.bfloat16)(model, x, i, side)

    compare_mixed(rank, world, WithFrozenInteger, step, f"frozen_first_forward/{mode}", mode=mode,
                  param_dtype=torch.bfloat16, reduce_dtype=torch.float32, before_step=freeze)


def bitfit(rank: int, world: int, mode: str) -> None:
    """Mixed precision with frozen parameters (test_fully_shard_frozen's BitFit under bf16): biases only trained."""
    def freeze(model, i):
        for name, p in model.named_parameters():
            p.requires_grad_("bias" in name)

    compare_mixed(rank, world, _stack, _plain(torch.bfloat16), f"bitfit_bf16/{mode}", mode=mode,
                  param_dtype=torch.bfloat16, before_step=freeze, units=["MLP"])


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


class PairLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, pair: Pair) -> Pair:
        return Pair(self.lin(pair.x), self.lin(pair.y))


class PairModel(nn.Module):
    """test_structured_input_output (dataclass): units taking and returning a dataclass of two activations."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PairLayer() for _ in range(2))

    def forward(self, x):
        pair = Pair(x, x.clone())
        for layer in self.layers:
            pair = layer(pair)
        return pair.x + pair.y


def structured(rank: int, world: int, mode: str, reduce_dtype: torch.dtype) -> None:
    compare_mixed(rank, world, PairModel, _plain(torch.bfloat16), f"structured/{reduce_dtype}/{mode}", mode=mode,
                  param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, units=["PairLayer"])


class TwoDtypes(nn.Module):
    """Parameters of two dtypes in one unit (an fp32 and a bf16 linear), its forward casting between them."""

    def __init__(self) -> None:
        super().__init__()
        self.wide, self.narrow = nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x):
        return self.narrow(torch.relu(self.wide(x)).to(torch.bfloat16)).float()


def several_dtypes(rank: int, world: int, mode: str) -> None:
    """Parameters of several dtypes in one module, no param_dtype: each computes, and is reduced, in its own."""
    compare_mixed(rank, world, lambda: nn.Sequential(TwoDtypes(), TwoDtypes()), _plain(torch.float32),
                  f"several_dtypes/{mode}", mode=mode, units=["TwoDtypes"])


class UpcastNorm(nn.Module):
    """An RMSNorm as HF writes it: the forward casts to fp32 for the statistics and back to the input's dtype."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = UpcastNorm(), MLP()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def forward_casts(rank: int, world: int, mode: str) -> None:
    """A module whose forward casts (test_submodules_with_external_inputs' user-owned casts): the blocks' norms
    compute their statistics in fp32 from bf16 activations."""
    compare_mixed(rank, world, lambda: nn.Sequential(NormBlock(), NormBlock()), _plain(torch.bfloat16),
                  f"forward_casts/{mode}", mode=mode, param_dtype=torch.bfloat16, units=["NormBlock"])


class Scaled(nn.Module):
    """A unit with a floating buffer in its forward (a fixed scale) and an integer one (kept int64)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("index", torch.arange(8))

    def forward(self, x):
        return self.lin(x)[:, self.index] * self.scale


def buffer_dtypes(rank: int, world: int, mode: str, buffer_dtype: Optional[torch.dtype]) -> None:
    """Buffers' dtype: ``buffer_dtype`` casts the floating buffers (the index stays int64); without it they stay
    fp32 and promote the bf16 activation they scale (the next unit casts it back)."""
    out = torch.bfloat16 if buffer_dtype == torch.bfloat16 else torch.float32
    compare_mixed(rank, world, lambda: nn.Sequential(Scaled(), Scaled()), _plain(out),
                  f"buffers/{buffer_dtype}/{mode}", mode=mode, param_dtype=torch.bfloat16, buffer_dtype=buffer_dtype,
                  units=["Scaled"], cast_inputs_of=(Scaled,))


# -- test_fully_shard_grad_scaler.py --------------------------------------------------------------------------------
def grad_scaler(rank: int, world: int, mode: str, has_inf: bool) -> None:
    """test_gradient_scaler (1-D): fp16 compute, ShardedGradScaler from 2.0; unscale_ multiplies each gradient shard
    by exactly 1/scale, every rank's found_inf is the agreed one (an inf on the last rank's shard only, has_inf), the
    step changes the parameters or leaves them and the optimizer state alone, and the scale backs off or stays."""
    from torch.amp.grad_scaler import OptState

    from lightning_shard.lightning.precision import ShardedGradScaler

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(2)))
    shard_module(model, sharding=mode, units=["Linear"], param_dtype=torch.float16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cpu", init_scale=2.0)
    scaler.scale(model(torch.randn(4, 4)).float().sum()).backward()
    inv_scale = scaler._scale.double().reciprocal().float()
    first = opt.param_groups[0]["params"][0]
    if has_inf and rank == world - 1:
        first.grad[0] = float("inf")
    initial = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    state = scaler._per_optimizer_states[id(opt)]
    assert [bool(f) for f in state["found_inf_per_device"].values()] == [has_inf], state["found_inf_per_device"]
    assert state["stage"].value == OptState.UNSCALED.value
    for p, grad in zip(model.parameters(), initial):
        torch.testing.assert_close(p.grad, grad * inv_scale, rtol=0, atol=0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert changed == [not has_inf] * len(before), changed
    assert (len(opt.state) == 0) == has_inf, opt.state
    scaler.update()
    assert scaler.get_scale() == (2.0 * scaler.get_backoff_factor() if has_inf else 2.0), scaler.get_scale()


# -- test_fully_shard_comm.py ----------------------------------------------------------------------------------------
def communication_count(rank: int, world: int, mode: str) -> list:
    """test_fully_shard_communication_count / test_fully_shard_backward_prefetch under bf16 compute with fp32
    reduction: a step all-gathers each unit once in forward order, again in backward in the reverse order (except
    the last, kept gathered; none under grad_op), and reduces each unit once, in the reverse order."""
    torch.manual_seed(0)
    model = _stack()
    runtime = shard_module(model, sharding=mode, units=["MLP"], param_dtype=torch.bfloat16,
                           reduce_dtype=torch.float32)
    names = [u.name for u in runtime.units]
    for step in range(2):  # (the first records the order; the second follows it)
        runtime.trace = []
        model(torch.randn(2, 8)).sum().backward()
    backward = [] if mode == "grad_op" else names[::-1][1:]
    expected = [("all_gather", n) for n in names + backward]
    gathers = [t for t in runtime.trace if t[0] == "all_gather"]
    assert gathers == expected, (gathers, expected)
    reduces = [t for t in runtime.trace if t[0] == "reduce"]
    assert reduces == [("reduce", n) for n in names[::-1]], reduces
    assert {op for op, _ in runtime.trace} == {"all_gather", "reduce"}, runtime.trace
    return runtime.trace
