"""The byte layout of a unit whose parameters differ in dtype (issue 48): which dtype each is gathered in, where its
bytes go in the gathered buffer, and the buffer rank 0 broadcasts at setup. ``mixed_shard.py`` stores it.

Each parameter is gathered in the dtype it computes in, cast only where the model asked for it: a floating
parameter in ``param_dtype`` when one is set (as a unit of one dtype is), anything else as it is stored; packed
quantized bytes (``quantized.py``) never, whatever their storage dtype.

Rank ``r`` owns bytes ``[r * S, (r + 1) * S)`` of the gathered buffer, so where a parameter is placed decides which
rank holds its master (and its optimizer state). The frozen parameters fill the buffer in the model's order; the
trainable ones (a unit's LoRA adapters: small, and all there is to reduce and step) are each given to the rank that
holds the fewest trainable elements so far, counted over the units built before (largest first), and placed at the
start of that rank's range: every rank steps about 1/N of the adapters, and a reduce-scatter moves about their
size, not N times it. (In the model's order a LoRA unit's adapters would fall on the ranks that hold the targeted
modules, the same ranks in every layer.)

A slot's offset is aligned to its gathered dtype's size, a packed weight's to its quantization blocks; ``S`` is a
multiple of the largest alignment, so every rank's part of a slot is whole elements (whole blocks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_shard.engine.plan.gathers import GatherDtypes
from lightning_shard.engine.storage import quantized
from lightning_shard.engine.storage.flat_shard import ParamSlot


@dataclass(frozen=True)
class MixedSlot(ParamSlot):
    """A :class:`ParamSlot` of a unit of several dtypes: ``offset`` is in *bytes* of the gathered buffer, ``numel``
    in elements of its own dtype."""

    master_dtype: torch.dtype = torch.float32  # as the model holds it: the shard's and the optimizer's
    gather_dtype: torch.dtype = torch.float32  # as the module computes with it
    align: int = 1  # bytes its offset, and its parts' boundaries, are a multiple of
    source: int = 0  # byte offset in the buffer broadcast at setup (master dtypes)
    packed: bool = False  # bytes of a quantized weight or of its quantization state: never cast, never trained
    quant: Optional[quantized.QuantSpec] = None  # the packed weight's (its state's slots: None)

    @property
    def casts(self) -> bool:
        return self.master_dtype != self.gather_dtype

    @property
    def gather_nbytes(self) -> int:
        return self.numel * self.gather_dtype.itemsize

    @property
    def master_nbytes(self) -> int:
        return self.numel * self.master_dtype.itemsize


def is_mixed(plan: Any, gathers: Optional[GatherDtypes] = None) -> bool:
    """Whether a unit's parameters need a unit of several dtypes: they differ in dtype, some are packed bytes, or
    (``gathers``) some are gathered in another dtype than the others."""
    for param, locations in plan.params:
        quantized.refuse_other_quantized(param, ".".join(filter(None, locations[0])))
    params = [param for param, _ in plan.params]
    if len({p.dtype for p in params}) > 1 or any(quantized.is_params4bit(p) for p in params):
        return True
    return gathers is not None and len({gathers.of(p, locations) for p, locations in plan.params}) > 1


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class MixedLayout:
    slots: list[MixedSlot]
    shard_nbytes: int  # S: each rank's range of the gathered buffer, in bytes


def flatten_mixed(root: nn.Module, plan: Any, param_dtype: Optional[torch.dtype], fqn: Callable[[str, str], str],
                  world: int, loads: list[int], gathers: Optional[GatherDtypes] = None) -> tuple[MixedLayout, Tensor]:
    """The unit's layout over ``world`` ranks, and its full buffer in master dtypes (identical on every rank once
    broadcast). ``loads``: trainable elements per rank in the units laid out before, updated."""
    slots, tensors = mixed_slots(root, plan, param_dtype, fqn, gathers)
    flat = torch.zeros(slots[-1].source + slots[-1].master_nbytes, dtype=torch.uint8, device=tensors[0].device)
    for slot, tensor in zip(slots, tensors):
        flat[slot.source : slot.source + slot.master_nbytes].view(slot.master_dtype).copy_(tensor.reshape(-1))
    layout = place(slots, world, loads)
    _check_biases(layout.slots)
    return layout, flat


def mixed_slots(root: nn.Module, plan: Any, param_dtype: Optional[torch.dtype], fqn: Callable[[str, str], str],
                gathers: Optional[GatherDtypes] = None) -> tuple[list[MixedSlot], list[Tensor]]:
    """The unit's slots in the model's order (not placed yet), and the tensor each holds. ``param_dtype``: where the
    unit computes lower, unless ``gathers`` says another dtype for a parameter (its own: cast="autocast")."""
    slots, tensors, source = [], [], 0
    for param, locations in plan.params:
        lowered = param_dtype if gathers is None or gathers.of(param, locations) != param.dtype else None
        names = tuple(fqn(m, a) for m, a in locations)
        where = tuple((root.get_submodule(m), a) for m, a in locations)
        entries = [(names, where, param.detach(), None)]
        if quantized.is_params4bit(param):
            spec, packed, states = quantized.describe(param, names[0])
            entries = [(names, where, packed, spec)]
            entries += [((spec.state_name(key),), (), tensor.detach(), None) for key, tensor in states]
        for names, where, tensor, spec in entries:
            packed = spec is not None or not where
            gather = _gather_dtype(tensor, packed, lowered)
            source = align_up(source, tensor.dtype.itemsize)
            slots.append(MixedSlot(names=names, locations=where, shape=tensor.shape, offset=0, numel=tensor.numel(),
                                   requires_grad=param.requires_grad and not packed, master_dtype=tensor.dtype,
                                   gather_dtype=gather, align=spec.block_bytes if spec is not None else gather.itemsize,
                                   source=source, packed=packed, quant=spec))
            tensors.append(tensor)
            source += slots[-1].master_nbytes
    return slots, tensors


def place(slots: list[MixedSlot], world: int, loads: list[int]) -> MixedLayout:
    """Byte offsets for ``slots`` (see the module note); in the model's order where the trainable ones do not fit
    their ranks' ranges (a trainable parameter larger than a rank's range)."""
    alignment = max(s.align for s in slots)
    bound = sum(s.gather_nbytes + s.align - 1 for s in slots)  # whatever the order: alignment's padding included
    shard = align_up(-(-bound // world), alignment)
    order = {id(s): i for i, s in enumerate(slots)}
    mine: list[list[MixedSlot]] = [[] for _ in range(world)]
    counted = list(loads)
    for slot in sorted((s for s in slots if s.requires_grad), key=lambda s: -s.numel):
        rank = min(range(world), key=lambda r: (counted[r], r))
        mine[rank].append(slot)
        counted[rank] += slot.numel
    frozen = [s for s in slots if not s.requires_grad]
    runs = [sorted(mine[r], key=lambda s: order[id(s)]) for r in range(world)]
    placed, offset = [], 0
    for rank in range(world):
        offset = max(offset, rank * shard)
        offset = _put(runs[rank] + (frozen if rank == world - 1 else []), offset, placed)
        while frozen and offset < (rank + 1) * shard and rank < world - 1:
            offset = _put([frozen.pop(0)], offset, placed)
    if offset > shard * world:  # in the model's order, each rank's range its share of the bytes
        placed = []
        end = _put(slots, 0, placed)
        return MixedLayout(placed, align_up(-(-end // world), alignment))
    loads[:] = counted
    return MixedLayout(placed, shard)


def _put(slots: list[MixedSlot], offset: int, placed: list[MixedSlot]) -> int:
    for slot in slots:
        offset = align_up(offset, slot.align)
        placed.append(dataclasses.replace(slot, offset=offset))
        offset += slot.gather_nbytes
    return offset


def part(slot: MixedSlot, shard_nbytes: int, rank: int) -> tuple[int, int]:
    """The elements of ``slot`` that ``rank`` holds, as offsets into the flattened parameter (may be empty)."""
    size, start = slot.gather_dtype.itemsize, rank * shard_nbytes
    end = slot.offset + slot.gather_nbytes
    lo = min(max(slot.offset, start), end)
    hi = max(lo, min(end, start + shard_nbytes))
    return (lo - slot.offset) // size, (hi - slot.offset) // size


def master_layout(slots: list[MixedSlot], shard_nbytes: int, rank: int) -> tuple[list[int], int]:
    """Each slot's byte offset in ``rank``'s master shard, and that shard's length: the rank's range as gathered,
    then each cast slot's part in its master dtype (mixed_shard.py)."""
    start = rank * shard_nbytes
    offsets, end = [], shard_nbytes
    for slot in slots:
        lo, hi = part(slot, shard_nbytes, rank)
        if not slot.casts:
            offsets.append(slot.offset + lo * slot.gather_dtype.itemsize - start if hi > lo else 0)
            continue
        end = align_up(end, slot.master_dtype.itemsize)
        offsets.append(end)
        end += (hi - lo) * slot.master_dtype.itemsize
    return offsets, end


def _check_biases(slots: list[MixedSlot]) -> None:
    for slot in slots:
        if slot.quant is not None:
            for module, _ in slot.locations:
                bias = next((s for s in slots if (module, "bias") in s.locations), None)
                if bias is not None:
                    quantized.check_bias(module, bias.gather_dtype, slot.names[0])


def _gather_dtype(tensor: Tensor, packed: bool, param_dtype: Optional[torch.dtype]) -> torch.dtype:
    if packed or param_dtype is None or not tensor.is_floating_point():
        return tensor.dtype
    return param_dtype
