"""Sharded model and optimizer state, written and read with ``torch.distributed.checkpoint``.

Each rank offers views of the shards it owns (see ``sharded_tensors``), keyed by parameter name:

* ``state_dict.<name>``: parameters in their own shapes, and buffers;
* ``current_model_state.<name>``: the weights being trained, where a weight-averaging callback put their average
  in ``state_dict`` (Lightning's layout, ``ShardedWeightAveraging``);
* ``optimizer_<i>.state.<name>.<key>``: elementwise optimizer states (sharded like their parameter),
  per-parameter scalars such as Adam's ``step``, and the states of whole-parameter optimizers (Muon,
  Adafactor) in their own shapes, written by the parameter's owner rank and read by its owner on load.

Parameter groups and other non-tensor optimizer state travel in the checkpoint's ``meta.pt`` with the
parameters named, not numbered. Nothing refers to ranks, world size or units, so a checkpoint saved on N
ranks loads on M ranks under another unit policy, each rank reading only the slices it owns.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.optim import Optimizer

from lightning_shard.checkpoint.files import CheckpointError, SafeReader
from lightning_shard.checkpoint.sharded_tensors import sharded_view
from lightning_shard.engine.runtime.averaging import AveragedShards
from lightning_shard.engine.runtime.hooks import ShardRuntime
from lightning_shard.engine.storage.flat_shard import FlatShard, ParamSlot

MODEL_PREFIX = "state_dict."
CURRENT_PREFIX = "current_model_state."  # the trained weights, where ``state_dict`` holds their average


def optimizer_prefix(index: int) -> str:
    return f"optimizer_{index}.state."


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every touch of a ShardedTensor that it prefers DTensor; our layout has no DTensor form."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def _slots(runtime: ShardRuntime) -> Iterator[tuple[FlatShard, ParamSlot, Tensor]]:
    for unit in runtime.units:
        for slot, param in zip(unit.storage.slots, unit.storage.shard_params):
            yield unit.storage, slot, param


def _view(runtime: ShardRuntime, storage: FlatShard, slot: ParamSlot, local: Tensor) -> Any:
    ranges = [storage.param_range(slot, r) for r in range(storage.world_size)]
    return sharded_view(slot.shape, ranges, storage.rank, local, runtime.shard_group_ranks)


def _buffers(runtime: ShardRuntime) -> dict[str, Tensor]:
    params = {name for _, slot, _ in _slots(runtime) for name in slot.names}
    with runtime.plain_state_dict():
        state = runtime.root.state_dict()
    return {k: v for k, v in state.items() if k not in params}


# -- model ------------------------------------------------------------------------------------------
def model_state(runtime: ShardRuntime, skip: AbstractSet[str] = frozenset(),
                average: Optional[AveragedShards] = None, to_load: bool = False) -> dict[str, Any]:
    """This rank's part of the model state by parameter and buffer name, as DCP items (views, no copies); the
    parameters named in ``skip`` left out. ``average``: the state of that average of the model's weights instead.
    The buffers: rank 0's, copied, to save (each rank keeps its own: ``rank0_buffers``); the module's, ``to_load``."""
    items: dict[str, Any] = {}
    runtime.adopt_rebound_shards()
    with _quiet():
        for i, unit in enumerate(runtime.units):
            storage = unit.storage
            for slot, param in zip(storage.slots, storage.shard_params):
                if slot.names[0] in skip:
                    continue
                local = param.detach() if average is None else average.shards[i][slice(*storage.shard_range(slot))]
                view = _view(runtime, storage, slot, local)
                if view is not None:
                    items.update({name: view for name in slot.names})
    if to_load:  # (DCP loads into them)
        items.update(_buffers(runtime))
    else:  # DCP writes a replicated item from any one rank: every rank's is rank 0's
        with nullcontext() if average is None else average.swapped(shards=False), runtime.rank0_buffers():
            items.update({k: v.clone() if isinstance(v, Tensor) else v for k, v in _buffers(runtime).items()})
    order = {name: i for i, name in enumerate(_state_order(runtime.root))}  # the unsharded module's key order
    return dict(sorted(items.items(), key=lambda item: order.get(item[0], len(order))))


def _state_order(root: nn.Module) -> Iterator[str]:
    """The names ``nn.Module.state_dict`` gives, in its order: each module's parameters, then its persistent
    buffers, then its children's."""
    for prefix, module in root.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        yield from (dot + name for name, param in module._parameters.items() if param is not None)
        yield from (dot + name for name, buffer in module._buffers.items()
                    if buffer is not None and name not in module._non_persistent_buffers_set)


def left_out_by_module(runtime: ShardRuntime) -> set[str]:
    """The names the root module's own ``state_dict`` leaves out: Lightning's documented way of not saving a part
    (a LightningModule overriding ``state_dict`` to drop its frozen encoder's keys). Names it adds or renames cannot
    name a parameter's shards: refused, naming them (a full checkpoint takes them as they are)."""
    root = runtime.root
    if type(root).state_dict is nn.Module.state_dict:
        return set()
    with runtime.plain_state_dict():
        own, given = list(nn.Module.state_dict(root)), set(root.state_dict())
    added = sorted(given.difference(own))
    if added:
        raise CheckpointError(
            f"{type(root).__name__}.state_dict() gives keys the module does not have ({_few(added)}): sharded"
            " checkpoints save each parameter's shards under its own name, and can only leave keys out. Rename"
            " keys in `on_save_checkpoint` (its `checkpoint['state_dict']` is keyed by name under either format),"
            " or use ShardStrategy(state_dict_type='full'), whose files hold what your state_dict() returns.")
    return {name for name in own if name not in given}


def model_shapes(runtime: ShardRuntime) -> dict[str, torch.Size]:
    shapes = {name: slot.shape for _, slot, _ in _slots(runtime) for name in slot.names}
    shapes.update({k: v.shape for k, v in _buffers(runtime).items() if isinstance(v, Tensor)})
    return shapes


def check_model_matches(metadata: Metadata, runtime: ShardRuntime, where: Path, strict: bool,
                        absent: AbstractSet[str] = frozenset(), prefix: str = MODEL_PREFIX,
                        names: Optional[Mapping[str, str]] = None) -> None:
    """``absent``: parameters the checkpoint was saved without on purpose (``save_frozen=False``); ``names``: the
    model's name of each checkpoint name to load (renamed or left out by ``on_load_checkpoint``), else all as saved."""
    saved = {k[len(prefix):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    if names is not None:
        saved = {model_name: saved[saved_name] for model_name, saved_name in names.items()}
    expected = {k: v for k, v in model_shapes(runtime).items() if k not in absent}
    wrong = [f"{name!r}: checkpoint {tuple(saved[name].size)}, model {tuple(shape)}"
             for name, shape in expected.items()
             if name in saved and isinstance(saved[name], TensorStorageMetadata) and saved[name].size != shape]
    if wrong:
        raise CheckpointError(f"Checkpoint {str(where)!r} does not fit the model, shapes differ: {_few(wrong)}")
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Checkpoint {str(where)!r} does not fit the model: missing from the checkpoint {_few(missing)},"
            f" not in the model {_few(unexpected)}. (Pass strict=False / `strict_loading = False` to load the overlap.)"
        )


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


@torch.no_grad()
def load_model_state(runtime: ShardRuntime, directory: Path, metadata: Metadata, strict: bool = True,
                     absent: AbstractSet[str] = frozenset(), prefix: str = MODEL_PREFIX,
                     names: Optional[Mapping[str, str]] = None) -> None:
    """``prefix``: which of the checkpoint's model states (:data:`MODEL_PREFIX`, :data:`CURRENT_PREFIX`); ``names``:
    as :func:`check_model_matches`'s."""
    check_model_matches(metadata, runtime, directory, strict, absent, prefix, names)
    if names is None:
        names = {k[len(prefix):]: k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix)}
    items = {prefix + names[k]: v for k, v in model_state(runtime, to_load=True).items() if k in names}
    _load(items, directory)
    runtime.refresh_gathered()


# -- optimizer --------------------------------------------------------------------------------------
def _param_names(runtime: ShardRuntime) -> dict[int, tuple[FlatShard, ParamSlot, str]]:
    return {id(param): (storage, slot, slot.names[0]) for storage, slot, param in _slots(runtime)}


def _named_groups(optimizer: Optimizer, names: dict[int, tuple[FlatShard, ParamSlot, str]]) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(
                "The optimizer holds a parameter that is not one of the sharded model's parameters; build the"
                " optimizer in `configure_optimizers` from `self.parameters()` / `self.named_parameters()`."
            )
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)][2] for p in group["params"]]})
    return groups


def optimizer_state(runtime: ShardRuntime, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's part of the optimizer state: ``tensors`` (DCP items, views) and the small rest. Every rank
    must call it (the owners' non-tensor state is gathered)."""
    runtime.optimizers.agree_on_groups(optimizer)
    names = _param_names(runtime)
    whole = runtime.optimizers.whole_states(optimizer)
    tensors: dict[str, Any] = {}
    elementwise: set[str] = set()
    other: dict[str, dict[str, Any]] = {}
    with _quiet():
        for param, state in optimizer.state.items():
            storage, slot, name = names[id(param)]
            for key, value in state.items():
                if isinstance(value, Tensor) and whole is not None:
                    tensors[f"{name}.{key}"] = value.detach()  # the owner's, in the parameter's shape
                elif isinstance(value, Tensor) and value.dim() > 0 and value.shape == param.shape:
                    elementwise.add(key)
                    view = _view(runtime, storage, slot, value.detach())
                    if view is not None:
                        tensors[f"{name}.{key}"] = view
                elif isinstance(value, Tensor) and value.dim() == 0:
                    tensors[f"{name}.{key}"] = value.detach()
                elif isinstance(value, Tensor):
                    raise ValueError(f"Optimizer state {key!r} of {name!r} has shape {tuple(value.shape)} for a shard"
                                     f" of shape {tuple(param.shape)}: only elementwise optimizer states can be sharded.")
                else:
                    other.setdefault(name, {})[key] = value
    if whole:  # owners on several ranks: rank 0 writes every owner's non-tensor state into meta.pt
        everyone: list = [None] * dist.get_world_size(runtime.group)
        dist.all_gather_object(everyone, other, group=runtime.group)
        other = {name: entry for theirs in everyone for name, entry in theirs.items()}
    return {"tensors": tensors, "param_groups": _named_groups(optimizer, names),
            "elementwise": sorted(elementwise), "other": other}


@torch.no_grad()
def load_optimizer_state(
    runtime: ShardRuntime, optimizer: Optimizer, index: int, saved: dict[str, Any], directory: Path, metadata: Metadata
) -> None:
    """Rebuild ``optimizer``'s state from checkpoint ``directory``: each rank reads the slices it owns."""
    runtime.optimizers.agree_on_groups(optimizer)
    names = _param_names(runtime)
    groups = _named_groups(optimizer, names)
    saved_groups = saved["param_groups"]
    if [g["params"] for g in groups] != [g["params"] for g in saved_groups]:
        raise CheckpointError(
            f"Optimizer {index} of checkpoint {str(directory)!r} has other parameter groups than the optimizer"
            f" being restored: saved {[len(g['params']) for g in saved_groups]} parameters per group, now"
            f" {[len(g['params']) for g in groups]}; first saved names {[g['params'][:2] for g in saved_groups]}."
        )
    prefix = optimizer_prefix(index)
    available: dict[str, dict[str, Any]] = {}  # parameter name -> {state key: metadata}
    for k, md in metadata.state_dict_metadata.items():
        if k.startswith(prefix):
            name, key = k[len(prefix):].rsplit(".", 1)
            available.setdefault(name, {})[key] = md
    elementwise = set(saved["elementwise"]) if runtime.optimizers.whole_states(optimizer) is None else set()
    items: dict[str, Any] = {}
    state: dict[int, dict[str, Any]] = {}
    position = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    with _quiet():
        for param in (p for g in optimizer.param_groups for p in g["params"]):
            if not runtime.optimizers.holds_state(optimizer, param):
                continue  # another rank owns it: that rank reads its state
            i = position[id(param)]
            storage, slot, name = names[id(param)]
            entry = dict(saved["other"].get(name, {}))
            for key, md in available.get(name, {}).items():
                if key in elementwise:
                    lo, hi = storage.param_range(slot, storage.rank)
                    local = torch.zeros(hi - lo, dtype=md.properties.dtype, device=storage.shard.device)
                    view = _view(runtime, storage, slot, local)
                    if view is not None:
                        items[f"{prefix}{name}.{key}"] = view
                else:
                    local = torch.zeros(md.size, dtype=md.properties.dtype)
                    items[f"{prefix}{name}.{key}"] = local
                entry[key] = local
            if entry:
                state[i] = entry
    _load(items, directory)
    optimizer.load_state_dict({
        "state": state,
        "param_groups": [{**s, "params": [position[id(p)] for p in g["params"]]}
                         for s, g in zip(saved_groups, optimizer.param_groups)],
    })


# -- DCP calls --------------------------------------------------------------------------------------
def save(items: dict[str, Any], directory: Path) -> None:
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1)
    with _quiet():
        dcp.save(items, storage_writer=writer)


def _load(items: dict[str, Any], directory: Path) -> None:
    with _quiet():
        dcp.load(items, storage_reader=SafeReader(str(directory)))


def read_metadata(directory: Union[str, Path]) -> Metadata:
    return SafeReader(str(directory)).read_metadata()


def rank_files(directory: Path, rank: int) -> list[str]:
    """The data files this rank wrote (DCP names them ``__<rank>_<n>.distcp``)."""
    return sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))
