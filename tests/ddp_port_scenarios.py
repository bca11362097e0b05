"""PyTorch's own DDP test scenarios (torch/testing/_internal/distributed/distributed_test.py ``test_ddp_*`` /
``test_DistributedDataParallel*``, test/distributed/test_c10d_common.py) ported onto the engine: each trains the same
model under torch's DistributedDataParallel and sharded (``shard_module``) in one gloo world, on the same per-rank
data, and checks every step's loss and gradients and the final weights to rtol 1e-5 / atol 1e-6 (fp32; 2 ranks sum
in one order, 3 ranks may sum in another: ~1e-7 relative). The DDP test each one ports is named in its docstring."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_shard.engine.shard_module import shard_module
from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.checkpoint.sharded import model_state
from tests.fsdp2_port_common import ATOL, RTOL, adamw, assert_same_grads


class Side:
    """What a step function may ask of its side: the module under the wrapper, no_sync(), its rank."""

    def __init__(self, net: nn.Module, rank: int, runtime=None) -> None:
        self.net, self.rank, self.runtime = net, rank, runtime
        self.module = net.module if isinstance(net, DDP) else net

    def no_sync(self):
        return self.net.no_sync() if self.runtime is None else self.runtime.no_sync()


Step = Callable[[nn.Module, torch.Tensor, int, Side], torch.Tensor]


def against_ddp(rank: int, world: int, build: Callable[[], nn.Module], step: Step, tag: str, steps: int = 4,
                rows: int = 2, dim: int = 8, ddp_kwargs: Optional[dict] = None, optimizer=adamw,
                update: Optional[Callable[[nn.Module], None]] = None, before_step=None, **shard_kwargs: Any):
    """``step(net, x, i, side)`` runs step ``i``'s forwards and backwards on this rank's chunk ``x`` and returns the
    loss. ``update(module)`` replaces the optimizer (a hand-written step). ``before_step(module, i)`` may freeze.
    Both sides see the same chunk and the same RNG state at each step. Returns (sharded, reference, runtime)."""
    g = torch.Generator().manual_seed(11)
    batches = [torch.randn(rows * world, dim, generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    reference = build()
    sharded = copy.deepcopy(reference)
    ddp = DDP(reference, **{"find_unused_parameters": True, **(ddp_kwargs or {})})
    runtime = shard_module(sharded, **shard_kwargs)
    ref_opt, opt = (optimizer(reference), optimizer(sharded)) if update is None else (None, None)
    for i, batch in enumerate(batches):
        x = batch.chunk(world)[rank]
        losses = []
        for net, o, module, rt in ((ddp, ref_opt, reference, None), (sharded, opt, sharded, runtime)):
            if o is not None:
                o.zero_grad(set_to_none=i % 2 == 0)
            else:
                module.zero_grad(set_to_none=True)
            if before_step is not None:
                before_step(module, i)
            torch.manual_seed(100 * i + rank)  # dropout: the same mask on both sides
            losses.append(step(net, x, i, Side(net, rank, rt)).detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=RTOL, atol=ATOL, msg=lambda m: f"[{tag}] step {i} "
                                   f"loss: {m}")
        has = [n for n, p in sharded.named_parameters() if p.grad is not None]
        expected = [n for n, p in reference.named_parameters() if p.grad is not None]
        assert has == expected, f"[{tag}] step {i}: gradients on {has}, DDP's on {expected}"
        assert_same_grads(sharded, reference, f"{tag}] step {i}")
        if update is None:
            ref_opt.step()
            opt.step()
        else:
            update(reference)
            update(sharded)
    _assert_same_state(runtime, sharded, reference, tag)
    return sharded, reference, runtime


def _assert_same_state(runtime, sharded: nn.Module, reference: nn.Module, tag: str) -> None:
    """The full parameters, and this rank's own buffers (DDP's differ across ranks after a forward that changes them:
    a full state dict holds rank 0's)."""
    mine = {name: b.clone() for name, b in sharded.named_buffers()}  # (read before full_state_dict)
    full = full_state_dict(runtime, rank0_only=False)
    for name, value in [*reference.named_parameters(), *reference.named_buffers()]:
        got = mine[name] if name in mine else full[name]
        torch.testing.assert_close(got, value.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"[{tag}] {n}: {m}")


def _sum_backward(net, x, i, side):
    loss = net(x).sum()
    loss.backward()
    return loss


# -- test_ddp_unused_params_rebuild_buckets / test_ddp_control_flow_same_across_ranks ------------------------------
class SometimesUsed(nn.Module):
    """A layer used on some steps only (the same on every rank): DDP's find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.step = 0

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.step % 3 != 1:
            h = torch.tanh(self.b(h))
        self.step += 1
        return self.c(h)


def unused_some_steps(rank, world, mode):
    against_ddp(rank, world, SometimesUsed, _sum_backward, f"unused_some_steps/{mode}", steps=6, sharding=mode,
                units=["Linear"])


# -- test_ddp_returns_tensor_with_no_grad / test_ddp_multiple_outputs -----------------------------------------------
class Outputs(nn.Module):
    """Returns an output, a tensor that needs no gradient, a parameter, and an output the loss leaves unused."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.unused_head = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        h = self.a(x)
        return {"out": h * self.scale, "no_grad": torch.ones(2), "param": self.scale, "unused": self.unused_head(h)}


def outputs_of_every_kind(rank, world, mode):
    def step(net, x, i, side):
        out = net(x)
        assert not out["no_grad"].requires_grad
        loss = out["out"].sum() + (out["param"] ** 2).sum() + out["no_grad"].sum()
        loss.backward()
        return loss

    against_ddp(rank, world, Outputs, step, f"outputs_of_every_kind/{mode}", sharding=mode, units=["Linear"])


# -- test_ddp_weight_sharing / test_ddp_shared_grad_acc_unused_params ----------------------------------------------
class Tied(nn.Module):
    """One weight shared by two layers in different units, used in another order each step."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.mid = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.second.weight = self.first.weight
        self.step = 0

    def forward(self, x):
        layers = [self.first, self.mid, self.second] if self.step % 2 == 0 else [self.second, self.mid, self.first]
        if self.step % 3 == 2:
            layers = [self.mid, self.second]  # first's bias unused
        self.step += 1
        for layer in layers:
            x = torch.tanh(layer(x))
        return x


def tied_in_different_orders(rank, world, mode):
    against_ddp(rank, world, Tied, _sum_backward, f"tied_in_different_orders/{mode}", steps=6, sharding=mode,
                units=["Linear"])


# -- test_accumulate_gradients_no_sync (with unused parameters) -----------------------------------------------------
def no_sync_different_used(rank, world, mode):
    """Three micro-batches per step, the first two under no_sync; ``b`` used in the first micro-batch only."""
    def step(net, x, i, side):
        total = 0.0
        for k, part in enumerate(x.chunk(3)):
            side.module.step = 0 if k == 0 else 1  # SometimesUsed skips b when step % 3 == 1
            if k < 2:
                with side.no_sync():
                    loss = net(part).sum()
                    loss.backward()
            else:
                loss = net(part).sum()
                loss.backward()
            total = total + loss.detach()
        return total

    against_ddp(rank, world, SometimesUsed, step, f"no_sync_different_used/{mode}", rows=6, sharding=mode,
                units=["Linear"])


# -- test_DistributedDataParallel_requires_grad (flipped between steps) ---------------------------------------------
def requires_grad_flipped(rank, world, mode):
    def freeze(module, i):
        module.b.requires_grad_(i % 2 == 1)
        module.a.bias.requires_grad_(i != 2)

    against_ddp(rank, world, SometimesUsed, _sum_backward, f"requires_grad_flipped/{mode}", steps=5, sharding=mode,
                units=["Linear"], before_step=freeze)


# -- test_ddp_create_graph: a gradient penalty through torch.autograd.grad(create_graph=True) -----------------------
def gradient_penalty(rank, world, mode):
    """The loss adds the squared norm of d(output)/d(input): its backward runs through the first backward's graph."""
    def step(net, x, i, side):
        x = x.clone().requires_grad_()
        out = net(x)
        (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = out.pow(2).mean() + slope.pow(2).sum()
        loss.backward()
        return loss

    against_ddp(rank, world, lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), step,
                f"gradient_penalty/{mode}", sharding=mode, units=["Linear"])


# -- backward on a non-scalar with a gradient argument; the whole model applied to its own output -------------------
def non_scalar_backward(rank, world, mode):
    def step(net, x, i, side):
        out = net(x)
        out.backward(gradient=torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        return out.sum()

    against_ddp(rank, world, lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), step,
                f"non_scalar_backward/{mode}", sharding=mode, units=["Linear"])


def model_applied_twice(rank, world, mode) -> str:
    """``model(model(x))``, one backward (DDP allows it with find_unused_parameters or static_graph). Returns '' or
    the failure."""
    forms = {"model(model(x))": lambda net, x: net(net(x))}
    for name, form in forms.items():
        def step(net, x, i, side, form=form):
            loss = form(net, x).sum()
            loss.backward()
            return loss

        try:
            against_ddp(rank, world, lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), step,
                        f"{name}/{mode}", sharding=mode, units=["Linear"])
        except AssertionError as err:
            return str(err)
    return ""


# -- a hand-written SGD step under torch.no_grad() -------------------------------------------------------------------
def hand_written_sgd(rank, world, mode):
    def update(module):
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad

    against_ddp(rank, world, lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), _sum_backward,
                f"hand_written_sgd/{mode}", sharding=mode, units=["Linear"], update=update)


# -- test_ddp_namedtuple / custom input classes ---------------------------------------------------------------------
@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    weights: torch.Tensor


class TakesStructures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, batch: Batch, extra: dict):
        return self.b(torch.tanh(self.a(batch.features))) * batch.weights + extra["shift"]


def structured_inputs(rank, world, mode):
    def step(net, x, i, side):
        loss = net(Batch(x, torch.linspace(0.5, 1.5, 8)), {"shift": x[:, :1]}).pow(2).sum()
        loss.backward()
        return loss

    against_ddp(rank, world, TakesStructures, step, f"structured_inputs/{mode}", sharding=mode, units=["Linear"])


# -- test_ddp_broadcast_buffer / train-eval switches with dropout and batch norm -------------------------------------
class NormDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.drop, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.drop(self.norm(torch.tanh(self.a(x)))))


def train_eval_switches(rank, world, mode, broadcast_buffers, save_at: int = -1):
    """Each step: an eval forward under no_grad (each rank's own running statistics, as DDP), then train.
    ``save_at``: a full state dict taken at the start of that step (a checkpoint), which DDP's state_dict() would
    leave each rank's buffers alone through."""
    evals = []

    def step(net, x, i, side):
        if i == save_at and side.runtime is not None:
            full_state_dict(side.runtime)
            full_state_dict(side.runtime, rank0_only=False)
            model_state(side.runtime)  # (a sharded checkpoint's items)
        side.module.eval()
        with torch.no_grad():
            evals.append(net(x).clone())
        side.module.train()
        return _sum_backward(net, x, i, side)

    _, reference, runtime = against_ddp(
        rank, world, NormDrop, step, f"train_eval/{mode}/{broadcast_buffers}/save_at={save_at}", rows=4, sharding=mode,
        units=["Linear"], broadcast_buffers=broadcast_buffers, ddp_kwargs={"broadcast_buffers": broadcast_buffers})
    for k in range(0, len(evals), 2):
        torch.testing.assert_close(evals[k + 1], evals[k], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"[train_eval/{mode}/{broadcast_buffers}] eval {k // 2}: {m}")


# -- bf16 autocast on the CPU (test_ddp_native_mixed_precision's autocast half) -------------------------------------
def cpu_autocast(rank, world, mode):
    def step(net, x, i, side):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        return loss

    against_ddp(rank, world, lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), step,
                f"cpu_autocast/{mode}", sharding=mode, units=["Linear"])


# -- torch.autograd.grad over the parameters instead of .backward() -------------------------------------------------
def autograd_grad_on_parameters(rank, world, mode) -> str:
    """DDP does not reduce what torch.autograd.grad returns (each rank's own gradients) and fills no .grad: the
    sharded model must return the same local gradients, leave every .grad None, and train on normally after."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    sharded = copy.deepcopy(reference)
    shard_module(sharded, sharding=mode, units=["Linear"])
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(3)).chunk(world)[rank]
    expected = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
    out = sharded(x).sum()
    try:
        got = torch.autograd.grad(out, [sharded[0].weight, sharded[2].weight])
    except RuntimeError as err:
        return str(err)
    for g, e in zip(got, (expected[0], expected[2])):
        torch.testing.assert_close(g.reshape(-1), e.reshape(-1), rtol=RTOL, atol=ATOL)
    assert all(p.grad is None for p in sharded.parameters()), "autograd.grad left .grad set"
    return ""


# -- test_sparse_gradients: a functional sparse embedding --------------------------------------------------------------
class FunctionalSparse(nn.Module):
    """A sparse gradient from F.embedding(sparse=True) called in forward, with no nn.Embedding(sparse=True) to see."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(nn.functional.embedding(ids, self.table, sparse=True))


def functional_sparse_gradient(rank, world) -> str:
    """Returns the error the step raises (the test checks it names the sparse gradient), '' if it trained."""
    model = FunctionalSparse()
    shard_module(model, units=["Linear"])
    try:
        model(torch.tensor([1, 2, 3])).sum().backward()
    except Exception as err:  # noqa: BLE001 (the message is the result)
        return f"{type(err).__name__}: {err}"
    return ""


def unit_called_before_the_root(rank, world, mode) -> dict:
    """``model(tanh(model[0](x)))``: a unit called outside any step, its output fed to the root's forward, one
    backward; SGD (lr 1) on the averaged gradients against one process on the global batch. Returns each
    parameter's largest difference."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model = copy.deepcopy(reference)
    runtime = shard_module(model, sharding=mode, units=["Linear"])
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(1))
    model(torch.tanh(model[0](x.chunk(world)[rank]))).sum().backward()
    reference(torch.tanh(reference[0](x))).sum().backward()
    for p in reference.parameters():
        p.grad /= world
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    state = full_state_dict(runtime, rank0_only=False)
    return {k: float((state[k] - v).abs().max()) for k, v in reference.state_dict().items()}
