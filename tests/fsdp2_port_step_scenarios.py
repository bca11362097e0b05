"""FSDP2's scenarios of steps with several forwards or backwards, units called outside the root's forward, and
accumulation (test_fully_shard_training.py, test_fully_shard_grad_acc.py, test_fully_shard_pending_grad.py,
test_fully_shard_clip_grad_norm_.py), each against one process on the same global batch
(fsdp2_port_common.compare)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_shard.checkpoint.full import full_state_dict
from tests.fsdp2_port_common import MLP, compare


class Norm(nn.LayerNorm):
    pass


class Head(nn.Linear):
    pass


class Raiser(nn.Module):
    """test_reset_iter_state_after_exception's wrapper: raises in forward while armed."""

    def __init__(self, wrapped: nn.Module) -> None:
        super().__init__()
        self.wrapped, self.armed = wrapped, False

    def forward(self, x):
        if self.armed:
            raise RuntimeError("boom")
        return self.wrapped(x)


class ChunkedHeadModel(nn.Module):
    """test_fully_shard_training's ChunkedHeadModel on float inputs: embed, a body of MLPs, a norm and a head (the
    head's unit its own), ``skip_head`` returning the hidden state for a chunked loss."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.body = Raiser(nn.Sequential(MLP(dim), MLP(dim)))
        self.norm, self.head = Norm(dim), Head(dim, 5)

    def forward(self, x, skip_head: bool = False):
        h = self.body(self.embed(x))
        return h if skip_head else self.head(self.norm(h))


UNITS = ["MLP", "Norm", "Head"]


def _plain(model, x, i, side):
    loss = model(x).sum()
    loss.backward()
    return loss


def non_root_forward_backward(rank: int, world: int, mode: str) -> None:
    """test_non_root_forward_backward: a step through the root, then one through its first unit alone."""
    def step(model, x, i, side):
        loss = (model if i % 2 == 0 else model[0])(x).sum()
        loss.backward()
        return loss

    compare(rank, world, lambda: nn.Sequential(*(MLP() for _ in range(3))), step, f"non_root/{mode}", mode=mode,
            units=["MLP"])


def chunked_head_loss(rank: int, world: int, mode: str) -> None:
    """test_partial_group_reshard_toggle (torchtitan's ChunkedCELoss): the hidden state detached, the head run and
    backpropagated on each chunk alone, then the body backpropagated from the chunks' input gradients."""
    def step(model, x, i, side):
        h = model(x, skip_head=True)
        grads, total = [], 0.0
        for chunk in h.detach().chunk(2):
            chunk = chunk.contiguous().requires_grad_(True)
            loss = model.head(model.norm(chunk)).pow(2).sum()
            loss.backward()
            grads.append(chunk.grad)
            total = total + loss.detach()
        h.backward(torch.cat(grads))
        return total

    compare(rank, world, ChunkedHeadModel, step, f"chunked_head/{mode}", rows=4, mode=mode, units=UNITS)


def double_forward(rank: int, world: int, mode: str, checkpointing: bool, prefetch: int = 1) -> None:
    """test_double_forward_with_nested_fsdp_and_checkpoint (DPO): two forwards, one backward of a loss of both; with
    test_explicit_prefetching's deeper prefetch (``prefetch``: units gathered ahead)."""
    def step(model, x, i, side):
        a, b = x.chunk(2)
        loss = (model(a).sum() - model(b).sum()).pow(2) / 100
        loss.backward()
        return loss

    compare(rank, world, ChunkedHeadModel, step, f"double_forward/{mode}/ckpt={checkpointing}/prefetch={prefetch}",
            rows=4, mode=mode, units=UNITS, activation_checkpointing=checkpointing, prefetch=prefetch)


def double_partial_forward(rank: int, world: int, mode: str) -> None:
    """test_double_partial_forward_then_backward: two forwards that skip the head, one backward: the head and norm
    get no gradient."""
    def step(model, x, i, side):
        a, b = x.chunk(2)
        loss = model(a, skip_head=True).sum() + model(b, skip_head=True).pow(2).sum()
        loss.backward()
        return loss

    compare(rank, world, ChunkedHeadModel, step, f"double_partial/{mode}", rows=4, mode=mode, units=UNITS)


def exception_in_forward(rank: int, world: int, mode: str) -> None:
    """test_reset_iter_state_after_exception: a forward raising inside the body (every rank), then steps as usual."""
    def step(model, x, i, side):
        if i == 1:
            model.body.armed = True
            try:
                model(x)
            except RuntimeError as err:
                assert "boom" in str(err)
            finally:
                model.body.armed = False
        return _plain(model, x, i, side)

    compare(rank, world, ChunkedHeadModel, step, f"exception_in_forward/{mode}", mode=mode, units=UNITS)


def accumulation(rank: int, world: int, mode: str, order: str) -> None:
    """test_gradient_accumulation / test_requires_gradient_sync_ ("all", gradients zeroed to tensors on odd steps):
    three micro-batches, all but the last under no_sync (``order="last"``); test_native_accumulation_dtypes' order
    (``"middle"``): reduced, then under no_sync, then reduced."""
    def step(model, x, i, side):
        total = 0.0
        for m, mb in enumerate(x.chunk(3)):
            unsynced = m < 2 if order == "last" else m == 1
            with side.no_sync() if unsynced else torch.enable_grad():
                loss = model(mb).sum()
                loss.backward()
            total = total + loss.detach()
        return total

    compare(rank, world, lambda: nn.Sequential(nn.Linear(8, 8), *(MLP() for _ in range(3))), step,
            f"accumulation/{order}/{mode}", rows=6, mode=mode, units=["MLP"])


def zero_grad_between_micro_batches(rank: int, world: int, mode: str, where: str) -> None:
    """test_grouped_clear_after_forward: a micro-batch backpropagated under no_sync, then gradients zeroed (to None
    on even steps, to zeros on odd ones) before the next micro-batch's forward (``where="before_forward"``: a step
    abandoned, as after a non-finite loss) or between its forward and backward (``"after_forward"``, FSDP2's test):
    only that micro-batch counts, as under DDP, whose no_sync accumulates in .grad, which zero_grad clears."""
    def step(model, x, i, side):
        first, second = x.chunk(2)
        if side.runtime is None:  # the reference: the first micro-batch's gradient is cleared anyway
            return _plain(model, second, i, side)
        with side.no_sync():
            model(first).sum().backward()
        if where == "before_forward":
            model.zero_grad(set_to_none=i % 2 == 0)
        loss = model(second).sum()
        if where == "after_forward":
            model.zero_grad(set_to_none=i % 2 == 0)
        loss.backward()
        return loss

    compare(rank, world, lambda: nn.Sequential(nn.Linear(8, 8), *(MLP() for _ in range(2))), step,
            f"zero_grad_between/{where}/{mode}", rows=4, mode=mode, units=["MLP"])


def clipped(rank: int, world: int, mode: str, norm_type: float) -> None:
    """test_clip_grad_norm_: clip_grad_norm_ over every unit's parameters, below the norm, each step."""
    def clip(model, runtime):
        params = list(model.parameters())
        if runtime is None:
            torch.nn.utils.clip_grad_norm_(params, 0.3, norm_type=norm_type)
        else:
            runtime.clip_grad_norm_(params, 0.3, norm_type=norm_type)

    compare(rank, world, lambda: nn.Sequential(nn.Linear(8, 8), *(MLP() for _ in range(3))), _plain,
            f"clip/{norm_type}/{mode}", mode=mode, units=["MLP"], after_grads=clip)


def abandoned_micro_batch(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict:
    """Per (compute dtype, how, mode): a micro-batch backpropagated under no_sync, then its gradients cleared by
    ``how`` ("optimizer": ``optimizer.zero_grad()``; "module": ``model.zero_grad()``; "loop": ``p.grad = None`` over
    ``model.parameters()``; "module after forward": ``model.zero_grad()`` between the next forward and its backward,
    where the root and the last unit are gathered; "only module after forward": no micro-batch abandoned, that
    ``model.zero_grad()`` the only clearing), against the same sharded model that never ran it and zeroes its
    gradients after each step, bit for bit (DDP's meaning: only the next micro-batch counts), and computing in fp32
    against one process on the kept micro-batches' global batch (rtol 1e-5, atol 1e-6). Returns the parameters that
    differ from either."""
    from lightning_shard.engine.shard_module import shard_module

    report = {}
    for dtype, how, mode in cases:
        g = torch.Generator().manual_seed(3)
        global_batches = [torch.randn(4 * world, 8, generator=g) for _ in range(4)]
        batches = [batch.chunk(world)[rank] for batch in global_batches]
        torch.manual_seed(0)
        build = lambda: nn.Sequential(nn.Linear(8, 8), *(MLP() for _ in range(2)), Head(8, 8))  # noqa: E731
        models, reference = [build(), build()], build()
        models[1].load_state_dict(models[0].state_dict())
        reference.load_state_dict(models[0].state_dict())
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        runtimes = [shard_module(m, sharding=mode, units=["MLP"], param_dtype=getattr(torch, dtype)) for m in models]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
        for i in range(2):
            abandoned, kept = batches[2 * i : 2 * i + 2]
            if not how.startswith("only"):
                with runtimes[0].no_sync():
                    models[0](abandoned).float().pow(2).mean().backward()
            if how == "optimizer":
                opts[0].zero_grad(set_to_none=i % 2 == 0)
            elif how == "module":
                models[0].zero_grad(set_to_none=i % 2 == 0)
            elif how == "loop":
                for p in models[0].parameters():
                    p.grad = None
            for model, opt in zip(models, opts):
                loss = model(kept).float().pow(2).mean()
                if how.endswith("module after forward") and model is models[0]:
                    model.zero_grad(set_to_none=i % 2 == 0)
                loss.backward()
                opt.step()
                if model is models[1] or not how.startswith("only"):
                    opt.zero_grad()
            reference(global_batches[2 * i + 1]).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        states = [full_state_dict(runtime, rank0_only=False) for runtime in runtimes]
        differ = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
        if dtype == "float32":  # (bf16 compute rounds otherwise than one fp32 process)
            differ += [f"one process: {k}" for k, v in reference.state_dict().items()
                       if not torch.allclose(states[0][k], v, rtol=1e-5, atol=1e-6)]
        report[(dtype, how, mode)] = differ
    return report
