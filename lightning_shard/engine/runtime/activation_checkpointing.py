"""Activation checkpointing per unit: a module's forward runs under ``torch.utils.checkpoint`` and is
recomputed in backward.

Note: the wrapper goes *inside* the unit's hooks (it replaces the module's ``forward``, so names and state
dicts do not change): the pre-forward hook gathers the unit, the checkpointed forward keeps only its
inputs, and the post-forward hook frees the unit. In backward the unit's pre-backward gathers it once,
and the recomputation and the unit's own backward both use that gather. The recomputation calls the
original ``forward`` directly, so no unit hook fires inside it: it gathers its unit itself where no
pre-backward did (a penalty's graph, backpropagated on its own, reaches the unit through no output of it).
A module holding another unit's members would recompute them ungathered, and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from lightning_shard.engine.plan.plan import UnitSpec, class_matches, validate_units
from lightning_shard.engine.runtime.trees import flatten

if TYPE_CHECKING:
    from lightning_shard.engine.storage.unit import Unit

CheckpointSpec = Union[bool, UnitSpec, Sequence[UnitSpec], None]


def validate_activation_checkpointing(spec: object) -> Union[bool, tuple[UnitSpec, ...]]:
    """``True`` (every unit), ``False``/``None`` (off), or module classes / class names."""
    if spec is None or isinstance(spec, bool):
        return bool(spec)
    specs = None
    if isinstance(spec, (str, type, list, tuple)):
        try:
            specs = validate_units(spec)  # type: ignore[arg-type]
        except TypeError:
            pass
    if not specs or "" in specs:
        raise ValueError(
            "`activation_checkpointing` must be True (every unit), False, or module classes / class names"
            f" (e.g. ['Block']); got {spec!r}."
        )
    return specs


def checkpoint_targets(
    root: nn.Module, unit_members: list[list[nn.Module]], spec: Union[bool, tuple[UnitSpec, ...]],
    inner: tuple[type, ...] = (),
) -> list[tuple[str, nn.Module]]:
    """The modules to checkpoint, by name; ``unit_members`` are the members of each unit but the root's. ``inner``:
    classes of units that may lie inside a checkpointed module (batch norms in fp32 under mixed precision: a
    recomputation gathers every unit it reads, see :func:`checkpoint_modules`), not checkpointed on their own."""
    if not spec:
        return []
    names = {id(m): name for name, m in root.named_modules()}
    unit_members = [members for members in unit_members if not all(isinstance(m, inner) for m in members)]
    if spec is True:
        targets = [m for members in unit_members for m in members]
    else:
        targets = [m for m in root.modules() if m is not root and class_matches(m, spec)]
        if not targets:
            raise ValueError(f"`activation_checkpointing` {list(spec)!r} matches no module of {type(root).__name__}.")
    _refuse_inside_parameter_wrappers(root, [names[id(m)] for m in targets])
    member_names = {id(m): ",".join(names[id(x)] for x in members) for members in unit_members for m in members}
    for module in targets:
        inner = [member_names[id(m)] for m in module.modules() if m is not module and id(m) in member_names]
        if inner:
            raise ValueError(
                f"activation_checkpointing: module {names[id(module)]!r} ({type(module).__name__}) contains unit"
                f" {inner[0]!r}; checkpoint modules that lie within one unit (e.g. the unit classes themselves)."
            )
    return [(names[id(m)], m) for m in targets]


def _refuse_inside_parameter_wrappers(root: nn.Module, targets: list[str]) -> None:
    """peft's LoRA on a parameter (``target_parameters``) adds its adapter to the parameter only while its wrapper
    runs (torch's parametrize): a module inside the wrapper, recomputed alone, would compute without it."""
    wrappers = [(name, m) for name, m in root.named_modules() if getattr(m, "parameter_name", None) is not None
                and hasattr(m, "get_base_layer")]
    for target in targets:
        for name, wrapper in wrappers:
            if target.startswith(name + "."):
                raise ValueError(
                    f"activation_checkpointing: module {target!r} lies inside peft's {name!r}, which adapts its"
                    f" parameter {wrapper.parameter_name!r} only while the wrapper runs: recomputed alone, it would"
                    f" compute without the adapter. Checkpoint a module that holds {name!r} (its layer or MoE block).")


def checkpoint_modules(
    root: nn.Module, units: list["Unit"], root_unit: Optional["Unit"], spec: Union[bool, tuple[UnitSpec, ...]],
    gather: Callable[["Unit"], None], inner: tuple[type, ...] = (),
) -> list[Callable[[], None]]:
    """Checkpoint the chosen modules; mark the units they read as needed in backward. Returns undo functions.
    ``gather``: gathers a unit (a no-op where it is gathered), called as each module's forward runs again; ``inner``:
    as :func:`checkpoint_targets`'s."""
    targets = checkpoint_targets(root, [unit.members for unit in units if unit is not root_unit], spec, inner)
    owners = _owning_units(units)
    undo = []
    for _name, module in targets:
        read = tuple({id(unit): unit for sub in module.modules() for unit in owners.get(id(sub), ())}.values())
        for unit in read:
            unit.checkpointed = True  # its parameters are needed again by the recomputation
        undo.append(wrap_forward(module, partial(_gather_all, gather, read)))
    return undo


def wrap_forward(module: nn.Module, before_run: Optional[Callable[[], Any]] = None) -> Callable[[], None]:
    forward = module.forward

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        kwargs = _without_cache(module, kwargs)
        # Each tensor goes in once. Under saved-tensor hooks (ours, for backward elision) the recomputation
        # gets a fresh object per input, so `attn(h, h, h)` would no longer see `query is key` and would
        # take another path than in forward.
        flat, rebuild = flatten((args, kwargs))
        tensors = list({id(x): x for x in flat if isinstance(x, Tensor)}.values())

        def run(*inputs: Tensor) -> Any:
            if before_run is not None:
                before_run()
            given = dict(zip(map(id, tensors), inputs))
            call_args, call_kwargs = rebuild([given.get(id(x), x) for x in flat])
            return forward(*call_args, **call_kwargs)

        return torch.utils.checkpoint.checkpoint(run, *tensors, use_reentrant=False)

    module.forward = checkpointed_forward  # type: ignore[method-assign]
    return lambda: delattr(module, "forward")


# what transformers' layers call the key/value cache they write into (its GradientCheckpointingLayer drops them too)
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A layer given a key/value cache to write into (an HF decoder layer in training, the model's ``use_cache``
    left on) is called without it: its recomputation would write the same keys into it again (a mask of another
    length, or a different number of tensors saved). Nothing reads a training forward's cache, and an empty one adds
    nothing to attention, so the numbers stay as they are. A cache that already holds keys (a prefix, a past passed
    in) does take part, and is refused. Layers that only read a cache say so as transformers lets them."""
    if getattr(module, "_can_checkpoint_with_cache", False):
        return kwargs
    given = [name for name in _CACHE_ARGUMENTS if _is_cache(name, kwargs.get(name))]
    for name in given:
        length = getattr(kwargs[name], "get_seq_length", None)
        if length is None or length() > 0:
            raise RuntimeError(
                f"lightning_shard: activation_checkpointing recomputes {type(module).__name__} in backward, and it was"
                f" given a `{name}` holding keys (a prefix, or a past passed in): the recomputation would write them"
                " into it a second time. Checkpoint other modules (activation_checkpointing=[...]), or turn it off.")
    return {**kwargs, **dict.fromkeys(given)} if given else kwargs


def _is_cache(name: str, value: Any) -> bool:
    """``cache=`` is a common name: only a transformers cache counts there; the older names are caches whatever holds
    them (tuples of tensors)."""
    return value is not None and (name != "cache" or hasattr(value, "get_seq_length"))


def _gather_all(gather: Callable[["Unit"], None], units: tuple["Unit", ...]) -> None:
    for unit in units:
        gather(unit)


def _owning_units(units: list["Unit"]) -> dict[int, list["Unit"]]:
    """Module id -> the units owning a parameter registered on that module."""
    owners: dict[int, list["Unit"]] = {}
    for unit in units:
        for slot in unit.storage.slots:
            for module, _attr in slot.locations:
                owners.setdefault(id(module), []).append(unit)
    return owners
