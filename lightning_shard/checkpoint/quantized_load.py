"""4-bit weights loaded into a sharded model (issue 48), each rank writing only its part of the packed bytes.

From full-precision weights (a bf16 or fp32 Hugging Face folder): each rank reads its part of each weight and
quantizes it itself. A rank's part of a packed weight is whole quantization blocks (``engine/storage/mixed_layout.py``), and
blockwise quantization is local to a block, so the packed bytes and absmax are those of bitsandbytes quantizing the
whole tensor. The absmax (one fp32 value per block: 1/16 byte per weight) is then gathered by every rank, which
computes the double quantization over all of it (its offset is a mean over every block) and keeps its part of
each state tensor. A rank holds its shards plus one weight's part (read, cast, quantized) and one unit's absmax.

From pre-quantized weights (the hub's ``*-bnb-4bit`` folders, or a full state dict of a 4-bit model): the packed
bytes by parts as any weight, and the quantization state entries bitsandbytes writes beside them
(``<weight>.absmax``, ``.quant_map``, ``.nested_absmax``, ``.nested_quant_map``, and the offset and layout inside
``.quant_state.bitsandbytes__<type>``, checked against the model's).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.engine.comm import collectives
from lightning_shard.engine.storage import quantized


def is_unquantized(value: Tensor, spec: quantized.QuantSpec) -> bool:
    return value.shape == spec.shape and value.is_floating_point()


def fits_packed(value: Tensor, slot: Any) -> bool:
    """A pre-quantized weight: the model's packed bytes, in any storage dtype."""
    return value.numel() * value.element_size() == slot.numel * slot.gather_dtype.itemsize


@torch.no_grad()
def load_packed(runtime: Any, walk: Any, found: dict[int, tuple[str, Tensor]], slots: list) -> None:
    """Fill the packed weights in ``found`` (slot index -> (name, value)), unit by unit in the same order on every
    rank (their collectives: which weights are quantized here depends on the files alone, the same on every rank)."""
    index = {id(slot): i for i, (_, slot, _) in enumerate(slots)}
    for unit in runtime.units:
        storage = unit.storage
        mine = [(j, index[id(slot)]) for j, slot in enumerate(storage.slots) if index.get(id(slot)) in found]
        if not mine:
            continue
        by_name = {slot.names[0]: j for j, slot in enumerate(storage.slots)}
        quantize = [j for j, i in mine if is_unquantized(found[i][1], storage.slots[j].quant)]
        parts = [_quantize_part(storage, j, walk, found[i][1]) for j, i in mine if j in quantize]
        for j, absmax in zip(quantize, _gather_absmax(runtime, storage, quantize, parts)):
            _write_states(storage, by_name, storage.slots[j].quant, quantized.state_tensors(absmax,
                                                                                          storage.slots[j].quant))
        for j, i in mine:
            if j not in quantize:
                _load_prequantized(storage, j, by_name, walk, *found[i])


def _blocks(storage: Any, j: int, rank: int) -> int:
    """How many quantization blocks of packed weight ``j`` ``rank`` holds (the last one may be partial)."""
    slot, spec = storage.slots[j], storage.slots[j].quant
    lo, hi = (bound * slot.gather_dtype.itemsize for bound in storage.param_range(slot, rank))
    first, end = 2 * lo, min(2 * hi, spec.shape.numel())
    return -(-end // spec.blocksize) - first // spec.blocksize if end > first else 0


def _gather_absmax(runtime: Any, storage: Any, quantize: list[int], parts: list[Tensor]) -> list[Tensor]:
    """Each weight's absmax, all its blocks, on every rank: the ranks' parts in one all-gather per unit."""
    if storage.world_size == 1 or not quantize:
        return parts
    counts = [[_blocks(storage, j, rank) for j in quantize] for rank in range(storage.world_size)]
    longest = max(map(sum, counts))
    local = torch.zeros(longest, dtype=torch.float32, device=storage.device)
    if parts:
        mine = torch.cat(parts).to(storage.device)
        local[: mine.numel()] = mine
    rows = collectives.all_gather(local.new_empty(longest * storage.world_size), local, runtime.groups.shard,
                                  runtime.stats, label="all-gather of absmax").wait().view(storage.world_size, -1)
    pieces = [row[: sum(n)].split(n) for row, n in zip(rows, counts)]
    return [torch.cat([piece[k] for piece in pieces]) for k in range(len(quantize))]


def _quantize_part(storage: Any, j: int, walk: Any, value: Tensor) -> Tensor:
    """Quantize this rank's part of a full-precision weight into its shard; returns the part's absmax."""
    slot, spec = storage.slots[j], storage.slots[j].quant
    lo, hi = (bound * slot.gather_dtype.itemsize for bound in storage.param_range(slot, storage.rank))  # bytes
    if hi == lo:
        return torch.zeros(0, device=storage.device)
    first, end = 2 * lo, min(2 * hi, spec.shape.numel())  # two values a byte; whole blocks (but the last)
    packed, absmax = quantized.quantize_part(walk.read(value, first, end).reshape(-1).to(storage.device), spec)
    storage.shard_params[j].detach().view(torch.uint8).copy_(packed)
    return absmax


def _load_prequantized(storage: Any, j: int, by_name: dict[str, int], walk: Any, key: str, value: Tensor) -> None:
    slot, spec = storage.slots[j], storage.slots[j].quant
    lo, hi = (bound * slot.gather_dtype.itemsize for bound in storage.param_range(slot, storage.rank))  # bytes
    size = value.element_size()
    if hi > lo:
        part = walk.read(value, lo // size, hi // size).contiguous().view(torch.uint8)
        storage.shard_params[j].detach().view(torch.uint8).copy_(part)
    source, name = underlying(walk, value)
    blob_name = next((n for n in (f"{name}.quant_state.bitsandbytes__{t}" for t in ("nf4", "fp4"))
                      if n in source.names()), None)
    wanted = [f"{name}.{key}" for key in spec.keys if key != "nested_offset"]
    absent = [n for n in wanted + [blob_name or f"{name}.quant_state.bitsandbytes__{spec.quant_type}"]
              if n not in source.names()]
    if absent:
        raise CheckpointError(f"{key!r} is stored packed (pre-quantized) but its quantization state is not: missing"
                              f" {absent}. Load the folder bitsandbytes saved whole, or full-precision weights.")
    saved = quantized.read_blob(source.whole(blob_name), spec, blob_name)
    states = {n.rsplit(".", 1)[1]: source.whole(n) for n in wanted}
    if spec.nested:
        states["nested_offset"] = torch.tensor([float(saved["nested_offset"])])
    _write_states(storage, by_name, spec, states)


def underlying(walk: Any, value: Optional[Tensor], name: Optional[str] = None) -> tuple[Any, str]:
    """The source a weight was read from (``value``, or the source's ``name``), and its name there, beneath the
    renamings of the files' names into the model's."""
    name = walk.origin[id(value)] if name is None else name
    source = walk.source
    while hasattr(source, "renamed"):
        name, source = source.renamed.get(name, name), source.source
    return source, name


def _write_states(storage: Any, by_name: dict[str, int], spec: quantized.QuantSpec, states: dict[str, Tensor]) -> None:
    """This rank's part of each of a weight's quantization state tensors, into their slots."""
    for key in spec.keys:
        j = by_name[spec.state_name(key)]
        slot, shard = storage.slots[j], storage.shard_params[j]
        full = states[key].reshape(-1)
        if full.numel() != slot.numel or full.dtype != slot.master_dtype:
            raise CheckpointError(f"{spec.state_name(key)!r}: {full.dtype} x {full.numel()} where the model holds"
                                  f" {slot.master_dtype} x {slot.numel}: another quantization (BitsAndBytesConfig).")
        lo, hi = storage.param_range(slot, storage.rank)
        shard.detach().copy_(full[lo:hi].to(shard.device))
