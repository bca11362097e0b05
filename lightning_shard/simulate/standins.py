"""What a simulated collective leaves in its outputs: what it would give if every rank held what this rank holds.

No data moves between ranks (there is one), so the outputs are stand-ins, finite wherever the inputs are: an
all-gather repeats this rank's shard, a reduce-scatter gives this rank's slice of the sum of ``n`` copies of its
input, an all-reduce the reduction of ``n`` copies, a broadcast leaves the tensor as it is. Decisions the ranks agree
on (a max of flags, objects exchanged) therefore come out as this rank's, as if every rank agreed with it.
Each function returns the bytes it wrote on the tensors' device (the time the writes take is taken off the modeled
time on CUDA, see occupancy.py). Writes go through ``.detach()`` and no_grad: a collective's mutation is no
autograd-visible change (torch's multi_threaded_pg does the same).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_SUM, _AVG, _PRODUCT = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT


def _op(op: object) -> object:
    return getattr(op, "op", op)  # a ReduceOp holds its RedOpType as .op


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@torch.no_grad()
def all_gather(output: Tensor, shard: Tensor, ranks: int) -> int:
    rows = output.detach().view(ranks, -1)
    source = shard.detach().reshape(1, -1)
    if source.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr():  # in place: the shard is a row
        source = source.clone()
    rows.copy_(source.expand(ranks, -1))
    return _nbytes(output)


@torch.no_grad()
def reduce_scatter(output: Tensor, flat: Tensor, ranks: int, rank: int, op: object) -> int:
    mine = flat.detach().reshape(ranks, -1)[rank].view_as(output)
    if _op(op) == _SUM and not output.dtype.is_complex and output.dtype != torch.bool:
        torch.mul(mine, ranks, out=output.detach())
    else:  # AVG, MIN, MAX of equal copies; a pre-multiplied sum's factor is not readable here
        output.detach().copy_(mine)
    return _nbytes(output)


@torch.no_grad()
def all_reduce(tensor: Tensor, ranks: int, op: object) -> int:
    op = _op(op)
    if op == _SUM and tensor.dtype != torch.bool:
        tensor.detach().mul_(ranks)
    elif op == _PRODUCT and tensor.dtype != torch.bool:
        tensor.detach().pow_(ranks)
    elif op == dist.ReduceOp.BXOR and ranks % 2 == 0:
        tensor.detach().zero_()
    else:  # AVG, MIN, MAX, BAND, BOR of equal copies, an odd XOR
        return 0
    return _nbytes(tensor)


@torch.no_grad()
def all_to_all(output: Tensor, flat: Tensor) -> int:
    if output.numel() == flat.numel():
        output.detach().view(-1).copy_(flat.detach().reshape(-1))
    else:  # uneven splits: what the other ranks would send is not known
        output.detach().zero_()
    return _nbytes(output)


@torch.no_grad()
def fill_each(outputs: list[Tensor], value: Tensor) -> int:
    """A list-form gather: every slot gets ``value``."""
    for out in outputs:
        out.detach().copy_(value.detach().view_as(out))
    return sum(_nbytes(out) for out in outputs)


@torch.no_grad()
def received(tensor: Tensor) -> int:
    """What a point-to-point receive left: zeros (the sender's values are not known)."""
    tensor.detach().zero_()
    return _nbytes(tensor)
