"""Turn a module into sharded units in place: the engine's entry point, usable without Lightning."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_shard.engine.comm.groups import build_groups, validate_shard_size, validate_sharding
from lightning_shard.engine.plan.gathers import GatherDtypes, validate_cast_params
from lightning_shard.engine.plan.materialize import Materializer
from lightning_shard.engine.plan.plan import (
    UnitPlan,
    UnitSpec,
    full_precision_classes,
    plan_units,
    root_heavy_warning,
    validate_min_unit_size,
)
from lightning_shard.engine.runtime.activation_checkpointing import (
    CheckpointSpec,
    checkpoint_modules,
    validate_activation_checkpointing,
)
from lightning_shard.engine.runtime.compile import (
    compile_units,
    refuse_with_elision,
    validate_compile,
    warn_if_compiled_by_user,
)
from lightning_shard.engine.runtime.hooks import ShardRuntime
from lightning_shard.engine.runtime.mirrors import misaligned_mirrors
from lightning_shard.engine.storage import quantized
from lightning_shard.engine.storage.flat_shard import FlatShard, ParamSlot
from lightning_shard.engine.storage.mixed_layout import flatten_mixed, is_mixed
from lightning_shard.engine.storage.mixed_shard import HostMixedShard, MixedShard
from lightning_shard.engine.storage.offload import HostShard, validate_offload
from lightning_shard.engine.storage.outside import adopt
from lightning_shard.engine.storage.refusals import (
    refuse_aliased_parameters,
    refuse_lazy,
    refuse_mixed_devices,
    refuse_pruned,
    refuse_sharded_parts,
    refuse_sparse_gradients,
)
from lightning_shard.engine.storage.unit import Unit


def shard_module(
    module: nn.Module,
    sharding: str = "full",
    units: Optional[Sequence[UnitSpec]] = None,
    unit_size: Optional[int] = None,
    min_unit_size: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    buffer_dtype: Optional[torch.dtype] = None,
    prefetch: int = 1,
    nonfinite: Optional[str] = None,
    device: Optional[torch.device] = None,
    elide_backward_gathers: bool = False,
    activation_checkpointing: CheckpointSpec = False,
    broadcast_buffers: bool = True,
    compile: object = False,
    shard_size: Optional[int] = None,
    mesh: Optional[DeviceMesh] = None,
    offload: Optional[str] = None,
    cast_params: str = "all",
) -> ShardRuntime:
    """Shard ``module``'s parameters across ``group`` and install the hooks that gather them on use.

    Every rank must call this with an identical model; rank 0's values are the ones kept (like DDP,
    which broadcasts rank 0's parameters), so ranks need not share a seed. A model built on the meta
    device is materialised on ``device`` unit by unit with its modules' ``reset_parameters()``: a rank
    holds its shards plus at most one full unit, never the whole model. ``compile``: ``True`` or torch.compile's
    keyword arguments compile each unit's blocks (engine/runtime/compile.py). ``sharding="hybrid"``: sharded within groups
    of ``shard_size`` consecutive ranks (default: LOCAL_WORLD_SIZE, the devices per node), replicated across
    them; or over the given 2-D ``mesh`` (replicate, shard) (engine/comm/groups.py). ``offload="optimizer"`` or
    ``"params"``: the master shards, their gradients and the optimizer state in host memory, stepped by the CPU
    (engine/storage/offload.py). ``cast_params``: which parameters are gathered in ``param_dtype``, every floating
    one or (``"autocast"``) those autocast would cast to it, the others in their own dtype (engine/plan/gathers.py).
    """
    validate_sharding(sharding)
    offload = validate_offload(offload)
    shard_size = validate_shard_size(shard_size, sharding)
    if mesh is not None and sharding != "hybrid":
        raise ValueError(f"`mesh` is for sharding='hybrid' (a 2-D DeviceMesh: replicate, shard), not {sharding!r}.")
    compile_options = validate_compile(compile)
    refuse_with_elision(compile_options, elide_backward_gathers)
    activation_checkpointing = validate_activation_checkpointing(activation_checkpointing)
    min_unit_size = validate_min_unit_size(min_unit_size, unit_size)
    cast_params = validate_cast_params(cast_params)
    options = {
        "sharding": sharding, "units": _spec_names(units), "unit_size": unit_size, "min_unit_size": min_unit_size,
        "param_dtype": param_dtype,
        "reduce_dtype": reduce_dtype, "buffer_dtype": buffer_dtype, "prefetch": prefetch, "nonfinite": nonfinite,
        "elide_backward_gathers": elide_backward_gathers,
        "activation_checkpointing": _spec_names(activation_checkpointing), "broadcast_buffers": broadcast_buffers,
        "compile": compile_options, "shard_size": shard_size, "offload": offload, "cast_params": cast_params,
    }
    existing = getattr(module, "_shard_runtime", None)
    if existing is not None:
        _check_resharding(existing, options, group, device, mesh)
        return existing
    refuse_sharded_parts(module)  # (before any collective: every rank raises the same)
    refuse_lazy(module)
    refuse_pruned(module)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1

    refuse_sparse_gradients(module)
    refuse_aliased_parameters(module)
    full_precision = full_precision_classes(param_dtype)
    gathers = GatherDtypes(module, param_dtype, cast_params)
    plans = plan_units(module, units=units, unit_size=unit_size, min_unit_size=min_unit_size, own_units=full_precision)
    if world > 1:
        _check_ranks_agree(plans, group)
    materializer = Materializer(module, device or _first_real_device(module))
    if offload is not None and materializer.device.type == "cpu" and rank == 0:
        warnings.warn(f"lightning_shard: offload={offload!r} on a CPU run saves no memory (the training state is in"
                      " host memory already) and costs some: its staging copies are host memory too. The host-step"
                      " path runs all the same.", stacklevel=2)
    groups = build_groups(sharding, group, shard_size, materializer.device, mesh)
    options["shard_size"] = groups.shard_size if sharding == "hybrid" else None  # the default taken, or the mesh's
    # under grad_op every unit stays gathered from its forward to its backward: the root is no worse than the rest
    root_heavy = root_heavy_warning(module, plans) if sharding in ("full", "hybrid") and world > 1 and rank == 0 else None
    if root_heavy:
        warnings.warn(root_heavy, stacklevel=2)
    compiled_by_user = warn_if_compiled_by_user(module, elide_backward_gathers) if rank == 0 else None
    if compiled_by_user:
        warnings.warn(compiled_by_user, stacklevel=2)
    built: list[Unit] = []
    root_unit = None
    trainable_loads = [0] * groups.shard_size  # units of several dtypes: trainable elements per rank (mixed_layout.py)
    for plan in plans:
        if not plan.params:
            continue
        quantized.materialize_unit(module, plan, materializer.device)  # (4-bit weights: packed, never full)
        materializer.unit(plan)
        is_root = plan.members == [""]
        members = [module.get_submodule(name) for name in plan.members]
        computes_in = None if not is_root and all(isinstance(m, full_precision) for m in members) else param_dtype
        refuse_mixed_devices(plan)
        unit_gathers = gathers.for_unit([p for p, _ in plan.params])
        mixed = is_mixed(plan, unit_gathers if computes_in is not None else None)
        if not mixed and computes_in is not None:  # one gather dtype: the parameters' own where autocast casts none
            first, locations = plan.params[0]
            computes_in = None if unit_gathers.of(first, locations) == first.dtype else computes_in
        slots, flat = (flatten_mixed(module, plan, computes_in, _fqn, groups.shard_size, trainable_loads, unit_gathers)
                       if mixed else _flatten(module, plan))
        for slot in slots.slots if mixed else slots:
            for owner, _ in slot.locations:
                adopt(owner)  # before the storage records the dict its parameters are registered in
        plan.params.clear()  # the unit's full tensors go with their last reference
        if world > 1:
            dist.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        storage_class = (MixedShard if mixed else FlatShard) if offload is None else (
            HostMixedShard if mixed else HostShard)
        storage = storage_class(slots, flat, groups.shard_rank, groups.shard_size, param_dtype=computes_in,
                                **({} if offload is None else {"keep_on_device": offload == "optimizer"}))
        del flat
        storage.use_shards()
        unit = Unit(plan.name, members, storage, reshard_after_forward=sharding in ("full", "hybrid") and not is_root)
        unit.index = len(built)
        built.append(unit)
        if is_root:
            root_unit = unit
    materializer.leftover_buffers()
    mirrors = misaligned_mirrors(module, built) if groups.shard_size > 1 and rank == 0 else None
    if mirrors:
        warnings.warn(mirrors, stacklevel=2)
    if buffer_dtype is not None:
        for submodule in module.modules():
            for name, buffer in submodule._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    submodule._buffers[name] = buffer.to(buffer_dtype)

    runtime = ShardRuntime(module, built, root_unit, groups, reduce_dtype=reduce_dtype, prefetch=prefetch,
                           nonfinite=nonfinite, elide_backward_gathers=elide_backward_gathers,
                           broadcast_buffers=broadcast_buffers)
    runtime.sync_buffers()  # rank 0's, as DDP starts
    if compile_options is not None:  # inside the checkpoint wrapper, which runs eagerly: it keys inputs by id()
        runtime.undo.extend(compile_units(built, root_unit, compile_options))
    runtime.undo.extend(checkpoint_modules(module, built, root_unit, activation_checkpointing, runtime.schedule.gather,
                                           inner=full_precision))
    runtime.install_guards()
    runtime.options = options
    module._shard_runtime = runtime
    _RUNTIMES.add(runtime)
    return runtime


_RUNTIMES: "weakref.WeakSet[ShardRuntime]" = weakref.WeakSet()  # every live runtime, for sharded_root_of


def sharded_root_of(module: nn.Module) -> tuple[Optional[ShardRuntime], str]:
    """The runtime of the sharded model ``module`` is (or lies in), and ``module``'s prefix there (``"model."`` for a
    LightningModule's ``self.model``; ``""`` for the root); ``(None, "")`` for a module outside any sharded model."""
    runtime = getattr(module, "_shard_runtime", None)
    if runtime is not None:
        return runtime, ""
    for runtime in list(_RUNTIMES):
        if runtime.hooks_installed:
            for name, sub in runtime.root.named_modules():
                if sub is module:
                    return runtime, f"{name}."
    return None, ""


def _spec_names(spec: object) -> object:
    """Module classes and class names compare by name (``[Block]`` and ``["Block"]`` are one policy)."""
    if isinstance(spec, (str, type)):
        spec = [spec]
    if isinstance(spec, (list, tuple)):
        return tuple(s.__name__ if isinstance(s, type) else s for s in spec)
    return spec


_DTYPE_SOURCES = " (ShardStrategy's mixed_precision, or the Trainer's precision)"


def _check_resharding(runtime: ShardRuntime, options: dict, group: Optional[dist.ProcessGroup],
                      device: Optional[torch.device], mesh: Optional[DeviceMesh]) -> None:
    """A module is sharded once: a second call (a second Trainer's setup) goes on with the same runtime when it
    asks for the same sharding, and is refused, naming the difference, when it does not (it would otherwise
    train silently under the first call's options)."""
    prefix = "lightning_shard: this model is sharded already"
    if not runtime.hooks_installed:
        raise RuntimeError(f"{prefix}, and its hooks were removed (`remove_hooks()`): its 1-D shard parameters"
                           " can no longer be gathered. Build a fresh model to shard it again.")
    before = getattr(runtime, "options", {})
    differ = [f"{k}={before[k]!r} then, {k}={v!r} now{_DTYPE_SOURCES if k.endswith('_dtype') else ''}"
              for k, v in options.items()
              if k in before and before[k] != v and not (k == "shard_size" and v is None)]  # None: the default
    if group is not runtime.group:
        differ.append("another process group")
    if mesh is not None and mesh is not runtime.groups.mesh:
        differ.append("another mesh")
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world != runtime.world_size:
        differ.append(f"world size {runtime.world_size} then, {world} now")
    if device is not None and runtime.units:
        held, wanted = runtime.units[0].storage.device, torch.device(device)
        if held.type != wanted.type or (wanted.index is not None and held.index != wanted.index):
            differ.append(f"device {held} then, {wanted} now")
    if differ:
        raise ValueError(
            f"{prefix} (by an earlier shard_module call or Trainer), with other options: {'; '.join(differ)}."
            " A sharded model keeps its sharding: use the same options again (a second Trainer then goes on"
            " training it), or build a fresh model for the new ones."
        )


def _check_ranks_agree(plans: list[UnitPlan], group: Optional[dist.ProcessGroup]) -> None:
    """Ranks built from different code or configs would exchange garbage (or hang): refuse at setup.

    Ours, not torch's ``_verify_param_shape_across_processes`` (DDP's): that one is private, needs real
    tensors (ours may be on the meta device) and names neither the parameter nor ``requires_grad``."""
    mine = [(plan.name, _fqn(*locations[0]), tuple(param.shape), str(param.dtype), param.requires_grad)
            for plan in plans for param, locations in plan.params]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        for ours, other in zip(reference + [None] * len(theirs), theirs + [None] * len(reference)):
            if ours != other:
                raise ValueError(
                    "Ranks disagree on the model to shard: rank 0 has (unit, parameter, shape, dtype, requires_grad)"
                    f" {ours}, rank {rank} has {other}. Every rank must build the same model and unit policy."
                )


def _flatten(root: nn.Module, plan: UnitPlan) -> tuple[list[ParamSlot], torch.Tensor]:
    """The unit's slots and full flat buffer (its parameters of one dtype: ``mixed_layout.py`` lays out the rest)."""
    slots, pieces, offset = [], [], 0
    for param, locations in plan.params:
        slots.append(
            ParamSlot(
                names=tuple(_fqn(m, a) for m, a in locations),
                locations=tuple((root.get_submodule(m), a) for m, a in locations),
                shape=param.shape,
                offset=offset,
                numel=param.numel(),
                requires_grad=param.requires_grad,
            )
        )
        pieces.append(param.detach().reshape(-1))
        offset += param.numel()
    return slots, torch.cat(pieces)


def _first_real_device(module: nn.Module) -> torch.device:
    real = next((t.device for t in (*module.parameters(), *module.buffers()) if not t.is_meta), None)
    return real or torch.device("cpu")


def _fqn(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr
