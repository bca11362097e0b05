"""Full (unsharded) model and optimizer state dicts in torch's ordinary format, gathered one unit at a time:
no rank ever holds the whole model at once beyond the result it returns.

An elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...) holds 1-D slices of the full state,
gathered here; a whole-parameter optimizer (Muon, Adafactor) holds each parameter's state whole on its owner
rank, sent here to rank 0. Both round-trip exactly; a tensor state that is neither is refused with a clear
error rather than silently mangled.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.sources import TensorSource
from lightning_shard.checkpoint.weights import load_into
from lightning_shard.engine.comm import collectives
from lightning_shard.engine.runtime.hooks import ShardRuntime
from lightning_shard.engine.storage.flat_shard import FlatShard, ParamSlot
from lightning_shard.engine.storage.mixed_shard import MixedShard
from lightning_shard.engine.storage.quantized import full_parameters


def gather_master(runtime: ShardRuntime, storage: FlatShard) -> Tensor:
    """Every rank's master shard, rank-major, on every rank (``storage.master_values`` reads each slot out of it)."""
    if storage.world_size == 1:
        return storage.shard
    out = storage.shard.new_empty(storage.shard.numel() * storage.world_size)
    return collectives.all_gather(out, storage.shard, runtime.groups.shard, runtime.stats).wait()


def gather_slots(runtime: ShardRuntime, storage: FlatShard, slots: list[int],
                 local: Optional[list[Tensor]] = None) -> list[Tensor]:
    """The full master values of some of a unit's parameters (or of their ``local`` parts of another tensor: an
    optimizer state), on every rank, moving only theirs (a unit's LoRA adapter, not its base weights): each rank's
    pieces, padded to the longest rank's, in one all-gather per dtype."""
    mine = local if local is not None else [storage.shard_params[s].detach() for s in slots]
    dtypes = list(dict.fromkeys(piece.dtype for piece in mine))
    if len(dtypes) > 1:  # a unit of several dtypes (engine/storage/mixed_shard.py): one all-gather each
        full: dict[int, Tensor] = {}
        for dtype in dtypes:
            chosen = [i for i, piece in enumerate(mine) if piece.dtype == dtype]
            gathered = gather_slots(runtime, storage, [slots[i] for i in chosen], [mine[i] for i in chosen])
            full.update(zip(chosen, gathered))
        return [full[i] for i in range(len(slots))]

    def pieces(rank: int) -> list[int]:
        return [hi - lo for lo, hi in (storage.param_range(storage.slots[s], rank) for s in slots)]

    if storage.world_size == 1:
        return [piece.view(storage.slots[s].shape) for piece, s in zip(mine, slots)]
    lengths = [pieces(r) for r in range(storage.world_size)]
    longest = max(map(sum, lengths))
    local = torch.nn.functional.pad(torch.cat(mine), (0, longest - sum(lengths[storage.rank])))
    out = local.new_empty(longest * storage.world_size)
    rows = collectives.all_gather(out, local, runtime.groups.shard, runtime.stats).wait().view(storage.world_size, -1)
    parts = [row[: sum(n)].split(n) for row, n in zip(rows, lengths)]
    return [torch.cat([part[i] for part in parts]).view(storage.slots[s].shape) for i, s in enumerate(slots)]


@torch.no_grad()
def full_state_dict(runtime: ShardRuntime, rank0_only: bool = True, skip: AbstractSet[str] = frozenset()) -> dict[str, Any]:
    """What ``state_dict()`` of the unsharded module returns (on CPU): its keys, after any state-dict hooks
    (``_register_state_dict_hook``, ``register_state_dict_post_hook``, ``_save_to_state_dict`` overrides ...),
    and its full values. The units are gathered one at a time into CPU copies, then registered in the
    module tree in place of the shards while ``state_dict()`` runs, so every hook sees full tensors.

    Every rank must call it (it all-gathers); with ``rank0_only`` other ranks get ``{}`` and keep nothing.
    Parameters named in ``skip`` are left out (a unit of them only is not even gathered).
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    runtime.adopt_rebound_shards()
    with runtime.rank0_buffers(everywhere=not rank0_only):  # what DDP's rank 0 would write (every rank enters)
        full: list[tuple[ParamSlot, Tensor]] = []
        for unit in runtime.units:
            storage = unit.storage
            if all(slot.names[0] in skip for slot in storage.slots):  # stands in for them: shapes, no memory
                full += [(slot, nn.Parameter(torch.empty(slot.shape, dtype=shard.dtype, device="meta"),
                                             requires_grad=False))
                         for slot, shard in zip(storage.slots, storage.shard_params)]
                continue
            flat = gather_master(runtime, storage)
            if keep:
                values = [value.to("cpu", copy=True) for value in storage.master_values(flat)]
                params = full_parameters(storage.slots, values, [shard.requires_grad for shard in storage.shard_params])
                full += list(zip(storage.slots, params))
            del flat
        if not keep:
            return {}
        # (a packed weight left out takes its quantization state, which bitsandbytes writes beside it, along)
        left_out = {name for slot, _ in full if slot.names[0] in skip for name in slot.names}
        packed_out = tuple(f"{name}." for slot, _ in full if getattr(slot, "quant", None) is not None
                           and slot.names[0] in skip for name in slot.names)
        with registered(full), runtime.plain_state_dict():
            state = runtime.root.state_dict()
        return {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()
                if k not in left_out and not (packed_out and k.startswith(packed_out))}


@contextmanager
def registered(full: list[tuple[ParamSlot, Tensor]]) -> Iterator[None]:
    """The module tree holds ``full``'s tensors where their slots live (ties included), then what it held."""
    held = [(module, attr, module._parameters[attr]) for slot, _ in full for module, attr in slot.locations]
    try:
        for slot, value in full:
            for module, attr in slot.locations:
                module._parameters[attr] = value
        yield
    finally:
        for module, attr, param in held:
            module._parameters[attr] = param


def load_full_state_dict(runtime: ShardRuntime, state: Mapping[str, Tensor], strict: bool = True,
                         absent: AbstractSet[str] = frozenset()) -> None:
    """Load an unsharded state dict: each rank copies only the slices its shards own. ``absent``: parameters it
    was saved without on purpose (``save_frozen=False``), not missing."""
    load_into(runtime, TensorSource(state), strict=strict, not_expected=absent.__contains__)


def _param_index(runtime: ShardRuntime, optimizer: Optimizer) -> dict[int, tuple[int, int, int]]:
    """id(shard param) -> (optimizer param index, unit index, slot index)."""
    where = {
        id(p): (u, s) for u, unit in enumerate(runtime.units) for s, p in enumerate(unit.storage.shard_params)
    }
    index = {}
    for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        if id(p) not in where:
            raise ValueError(
                "The optimizer holds a parameter that is not one of the sharded model's parameters; build the"
                " optimizer in `configure_optimizers` from `self.parameters()` / `self.named_parameters()`."
            )
        index[id(p)] = (i, *where[id(p)])
    return index


def _is_elementwise(value: Any, param: Tensor, name: str) -> bool:
    if not isinstance(value, Tensor) or value.dim() == 0:
        return False
    if value.shape != param.shape:
        raise ValueError(
            f"Optimizer state {name!r} has shape {tuple(value.shape)} for a parameter shard of shape"
            f" {tuple(param.shape)}: only elementwise optimizer states can be sharded."
        )
    return True


@torch.no_grad()
def full_optimizer_state_dict(runtime: ShardRuntime, optimizer: Optimizer, rank0_only: bool = True) -> dict:
    """Every rank must call it; returns the state as ``optimizer.state_dict()`` on the unsharded model."""
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    runtime.optimizers.agree_on_groups(optimizer)
    local = optimizer.state_dict()
    index = _param_index(runtime, optimizer)
    state: dict[int, dict[str, Any]] = {}
    spread = runtime.optimizers.whole_states(optimizer)
    if spread is not None:  # whole-parameter states: each on its owner (spread) or on every rank
        state = {index[id(p)][0]: {k: _to_cpu(v) for k, v in s.items()} for p, s in optimizer.state.items()}
        if spread:
            everyone: list = [None] * dist.get_world_size(runtime.group)
            dist.all_gather_object(everyone, state, group=runtime.group)
            state = {i: entry for theirs in everyone for i, entry in theirs.items()}
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]} if keep else {}
    for unit in runtime.units:
        storage = unit.storage
        entries = [(s, p) for s, p in enumerate(storage.shard_params) if id(p) in index and p in optimizer.state]
        keys = sorted({k for _, p in entries for k in optimizer.state[p]})
        for key in keys:
            elementwise = [s for s, p in entries if key in optimizer.state[p]
                           and _is_elementwise(optimizer.state[p][key], p, key)]
            if elementwise and isinstance(storage, MixedShard):  # no flat layout of elements: slot by slot
                values = gather_slots(runtime, storage, elementwise,
                                      [optimizer.state[storage.shard_params[s]][key] for s in elementwise])
                whole = dict(zip(elementwise, values))
            elif elementwise:
                sample = optimizer.state[storage.shard_params[elementwise[0]]][key]
                flat = storage.shard.new_zeros(storage.shard_numel, dtype=sample.dtype)
                for s in elementwise:
                    lo, hi = storage.shard_range(storage.slots[s])
                    flat[lo:hi] = optimizer.state[storage.shard_params[s]][key]
                full = _gather(runtime, flat) if storage.world_size > 1 else flat
            for s, p in entries:
                if key not in optimizer.state[p]:
                    continue
                slot = storage.slots[s]
                value = optimizer.state[p][key]
                if s in elementwise:
                    value = whole[s] if isinstance(storage, MixedShard) else \
                        full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                state.setdefault(index[id(p)][0], {})[key] = _to_cpu(value)
    if not keep:
        return {}
    return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}


def _gather(runtime: ShardRuntime, flat: Tensor) -> Tensor:
    out = flat.new_empty(flat.numel() * runtime.groups.shard_size)
    return collectives.all_gather(out, flat, runtime.groups.shard, runtime.stats).wait()


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, Tensor) else copy.deepcopy(value)


@torch.no_grad()
def load_full_optimizer_state_dict(runtime: ShardRuntime, optimizer: Optimizer, full: dict) -> None:
    """Load a full optimizer state dict: each rank keeps only its slices."""
    runtime.optimizers.agree_on_groups(optimizer)
    index = _param_index(runtime, optimizer)
    n_params = sum(len(g["params"]) for g in optimizer.param_groups)
    n_saved = sum(len(g["params"]) for g in full["param_groups"])
    if n_saved != n_params:
        raise ValueError(f"Optimizer state holds {n_saved} parameters but the optimizer has {n_params}.")
    state = {}
    whole = runtime.optimizers.whole_states(optimizer) is not None
    params = {i: p for p in (p for g in optimizer.param_groups for p in g["params"]) for i in [index[id(p)][0]]}
    for i, u, s in index.values():
        saved = full["state"].get(i)
        if saved is None or not runtime.optimizers.holds_state(optimizer, params[i]):
            continue
        if whole:  # in the parameter's own shape, on its owner
            state[i] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in saved.items()}
            continue
        storage = runtime.units[u].storage
        slot = storage.slots[s]
        start, end = storage.param_range(slot, storage.rank)
        local = {}
        for key, value in saved.items():
            if isinstance(value, Tensor) and value.shape == slot.shape and value.dim() > 0:
                value = value.reshape(-1)[start:end].clone()  # not a view of a mapped file
            local[key] = value
        state[i] = local
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})
