"""Which parameters become which unit.

A *unit* is the granularity of communication: its parameters are flattened into one buffer that is
all-gathered and reduce-scattered with one collective. A unit has one or more *member* modules
(several only when ``unit_size`` packs consecutive siblings); its parameters are those registered in
its members' subtrees and not claimed by a nested unit. Whatever no unit claims belongs to the root
unit. A parameter shared by modules of different units (tied weights) belongs to the innermost unit
that encloses all of them, so it is gathered whenever any of its users runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

UnitSpec = Union[str, type]


@dataclass
class UnitPlan:
    """One planned unit: its member modules (by name) and the parameters it owns."""

    members: list[str]
    # each owned parameter once, with every (module name, attribute) under which it is registered
    params: list[tuple[nn.Parameter, list[tuple[str, str]]]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return ",".join(m or "<root>" for m in self.members)

    def numel(self) -> int:
        return sum(p.numel() for p, _ in self.params)


def validate_units(units: Optional[Union[UnitSpec, Sequence[UnitSpec]]]) -> Optional[tuple[UnitSpec, ...]]:
    if units is None:
        return None
    if isinstance(units, (str, type)):
        units = [units]
    units = tuple(units)
    for u in units:
        if not isinstance(u, (str, type)) or (isinstance(u, type) and not issubclass(u, nn.Module)):
            raise TypeError(
                f"`units` entries must be nn.Module classes or class names (str), got {u!r} of type {type(u).__name__}."
            )
    return units


def validate_unit_size(unit_size: object) -> Optional[int]:
    if unit_size is None:
        return None
    if isinstance(unit_size, bool) or not isinstance(unit_size, int) or unit_size <= 0:
        raise ValueError(f"`unit_size` must be a positive int (a number of parameters), got {unit_size!r}.")
    return unit_size


def validate_min_unit_size(min_unit_size: object, unit_size: Optional[int] = None) -> Optional[int]:
    if min_unit_size is None:
        return None
    if isinstance(min_unit_size, bool) or not isinstance(min_unit_size, int) or min_unit_size <= 0:
        raise ValueError(f"`min_unit_size` must be a positive int (a number of parameters) or None,"
                         f" got {min_unit_size!r}.")
    if unit_size is not None and min_unit_size > unit_size:
        raise ValueError(f"`min_unit_size` ({min_unit_size}) is above `unit_size` ({unit_size}): units cannot be both"
                         " at most unit_size and at least min_unit_size parameters.")
    return min_unit_size


def plan_units(
    root: nn.Module,
    units: Optional[Sequence[UnitSpec]] = None,
    unit_size: Optional[int] = None,
    min_unit_size: Optional[int] = None,
    own_units: tuple[type, ...] = (),
) -> list[UnitPlan]:
    """Return the unit plans, innermost first and the root unit last.

    With neither ``units`` nor ``unit_size``: inside an HF model the blocks it declares (``_no_split_modules``),
    elsewhere the outermost *blocks* whose class occurs more than once: a transformer's layers, whether their
    class is the user's or torch's own (``nn.TransformerEncoderLayer``). A block is a module with
    parameterised children; leaves such as norms and containers (``nn.Sequential``, ``nn.ModuleList``) are
    not, so a final norm outside the layers stays in the root unit instead of becoming a tiny unit of its own.

    ``min_unit_size``: consecutive sibling units smaller than this are merged, so that each collective moves
    enough to amortise its fixed cost (the hooks and the collective's own latency, per unit and per step).
    ``own_units``: modules of these classes are each a unit of their own, whatever the policy (see
    :func:`full_precision_classes`).
    """
    if units is not None and unit_size is not None:
        raise ValueError("Give either `units` (module classes) or `unit_size` (a parameter budget), not both.")
    if unit_size is not None:
        member_groups = _pack_by_size(root, unit_size)
    else:
        member_groups = [[name] for name in _match_classes(root, units)]
    if min_unit_size is not None:
        member_groups = _merge_small(root, member_groups, min_unit_size, unit_size)
    if own_units:
        own = [name for name, module in root.named_modules() if name and isinstance(module, own_units)]
        member_groups = [kept for kept in ([m for m in group if m not in own] for group in member_groups) if kept]
        member_groups += [[name] for name in own]
    return _assign_params(root, member_groups)


def full_precision_classes(param_dtype: Optional[torch.dtype]) -> tuple[type, ...]:
    """Under mixed precision, batch norms are units of their own that compute in their parameters' dtype (FSDP1's
    MixedPrecision leaves them alone too): torch's batch norm takes a low-precision input with fp32 weights and fp32
    running statistics, as under autocast without sharding, but not bf16 weights beside fp32 statistics."""
    return (nn.modules.batchnorm._BatchNorm,) if param_dtype is not None else ()


def _merge_small(root: nn.Module, groups: list[list[str]], floor: int, cap: Optional[int]) -> list[list[str]]:
    """Merge each group below ``floor`` parameters with the next one when both lie in one container (the blocks of
    one ``ModuleList`` or ``Sequential``, which a model calls in order) and the result stays within ``cap``
    (``unit_size``); a small group left at the end of a container joins the one before it."""
    def container(group: list[str]) -> Optional[str]:
        parents = {name.rpartition(".")[0] for name in group}
        if len(parents) != 1:
            return None
        parent = parents.pop()
        return parent if parent and isinstance(root.get_submodule(parent), _CONTAINERS) else None

    def numel(group: list[str]) -> int:
        return sum(_subtree_numel(root.get_submodule(name)) for name in group)

    def mergeable(first: list[str], second: list[str]) -> bool:
        return (container(first) is not None and container(first) == container(second)
                and (cap is None or numel(first) + numel(second) <= cap))

    merged: list[list[str]] = []
    for group in groups:
        if merged and numel(merged[-1]) < floor and mergeable(merged[-1], group):
            merged[-1].extend(group)
        elif len(merged) > 1 and numel(merged[-1]) < floor and mergeable(merged[-2], merged[-1]):
            merged[-2].extend(merged.pop())  # the last of a container, too small: joins the one before
            merged.append(list(group))
        else:
            merged.append(list(group))
    if len(merged) > 1 and numel(merged[-1]) < floor and mergeable(merged[-2], merged[-1]):
        merged[-2].extend(merged.pop())
    return merged


def class_matches(module: nn.Module, specs: Sequence[UnitSpec]) -> Optional[UnitSpec]:
    for spec in specs:
        if (isinstance(spec, str) and type(module).__name__ == spec) or (
            isinstance(spec, type) and isinstance(module, spec)
        ):
            return spec
    return None


def _match_classes(root: nn.Module, specs: Optional[Sequence[UnitSpec]]) -> list[str]:
    if specs is None:
        return _default_members(root)
    used: set = set()
    names: list[str] = []
    tuners: list[str] = []  # peft's adapter layers: what they wrap stays with them (_reads_children_uncalled)
    for name, module in root.named_modules():
        spec = class_matches(module, specs) if module is not root else None
        tuner = next((t for t in tuners if name.startswith(t + ".")), None)
        if _reads_children_uncalled(module) and tuner is None:
            tuners.append(name)
        if spec is not None:
            used.add(spec)
            # a match inside an adapter layer (the experts peft's `target_parameters` wraps): the layer is the unit
            if (tuner or name) not in names:
                names.append(tuner or name)
    unused = [spec if isinstance(spec, str) else spec.__qualname__ for spec in specs if spec not in used]
    if unused:  # a typo would otherwise train the whole model unsharded
        present = sorted({type(m).__name__ for m in root.modules() if m is not root and _has_params(m)})
        raise ValueError(f"`units` entries {unused} match no module of {type(root).__name__}; its classes with"
                         f" parameters are {present}.")
    return names


def _declares_blocks(module: nn.Module) -> bool:
    """An HF transformers model names the blocks it must not be split within (``_no_split_modules``, what
    accelerate's FSDP auto-wrap uses): T5's ``T5Block`` rather than its two stacks, BERT's embeddings too."""
    return bool(getattr(module, "_no_split_modules", None))


def _default_members(root: nn.Module) -> list[str]:
    """The outermost modules that are a declared block (inside an HF model) or, elsewhere, an instance of a
    block class that occurs more than once there (a transformer's layers, the user's class or torch's)."""
    declared = {name for m in root.modules() if _declares_blocks(m) for name in m._no_split_modules}
    repeated = _repeated_block_classes(root)
    names: list[str] = []

    def visit(module: nn.Module, name: str, in_hf_model: bool) -> None:
        in_hf_model = in_hf_model or _declares_blocks(module)
        if module is not root and _has_params(module) and (
                type(module) in repeated if not in_hf_model else type(module).__name__ in declared):
            names.append(name)  # its nested blocks (a layer's attention) are no units of their own
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, in_hf_model)

    visit(root, "", False)
    return names


def _repeated_block_classes(root: nn.Module) -> set[type]:
    """Block classes with more than one instance outside HF models (those declare their own blocks)."""
    counts: dict[type, int] = {}

    def count(module: nn.Module) -> None:
        if _declares_blocks(module):
            return
        if module is not root and _is_block(module):
            counts[type(module)] = counts.get(type(module), 0) + 1
        for child in module.children():
            count(child)

    count(root)
    return {cls for cls, n in counts.items() if n > 1}


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_block(module: nn.Module) -> bool:
    return not isinstance(module, _CONTAINERS) and any(_has_params(c) for c in module.children())


def _splittable(module: nn.Module) -> bool:
    builtin = type(module).__module__.startswith("torch.nn") and not isinstance(module, _CONTAINERS)
    return not builtin and not _reads_children_uncalled(module) and any(_has_params(c) for c in module.children())


def _reads_children_uncalled(module: nn.Module) -> bool:
    """peft's adapter layers read their adapters' weights without calling them (LoRA on a parameter, DoRA's
    magnitudes): each stays in one unit with what it wraps."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return tuners is not None and isinstance(module, tuners.BaseTunerLayer)


def _subtree_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _pack_by_size(root: nn.Module, budget: int) -> list[list[str]]:
    """Pack consecutive sibling subtrees into groups of at most ``budget`` parameters.

    A subtree larger than the budget is split among its children; a leaf larger than the budget
    becomes a unit of its own (a module cannot be split).

    Note: a unit's hooks fire only when its members are *called*. ``torch.nn`` built-ins other than
    containers are therefore never split (``nn.MultiheadAttention`` reads ``out_proj.weight`` without
    calling ``out_proj``), nor peft's adapter layers; user modules that do the same should be wrapped by class
    instead.
    """
    groups: list[list[str]] = []

    def pack(module: nn.Module, prefix: str) -> None:
        current: list[str] = []
        current_size = 0
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            size = _subtree_numel(child)
            if size == 0:
                continue
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # never called: its hooks would never fire
                if current:
                    groups.append(current)
                current, current_size = [], 0
                pack(child, name + ".")
            elif size > budget:
                if current:
                    groups.append(current)
                current, current_size = [], 0
                if _splittable(child):
                    pack(child, name + ".")
                else:
                    groups.append([name])
            elif current_size + size <= budget:
                current.append(name)
                current_size += size
            else:
                groups.append(current)
                current, current_size = [name], size
        if current:
            groups.append(current)

    if _subtree_numel(root) > budget:
        pack(root, "")
    return groups


def _assign_params(root: nn.Module, member_groups: list[list[str]]) -> list[UnitPlan]:
    plans = [UnitPlan(members=group) for group in member_groups]
    root_plan = UnitPlan(members=[""])
    unit_of_member = {m: plan for plan in plans for m in plan.members}

    def enclosing_units(module_name: str) -> list[UnitPlan]:
        """Units enclosing a module, innermost first, ending with the root unit."""
        chain = []
        parts = module_name.split(".") if module_name else []
        for i in range(len(parts), 0, -1):
            plan = unit_of_member.get(".".join(parts[:i]))
            if plan is not None:
                chain.append(plan)
        chain.append(root_plan)
        return chain

    refs: dict[int, tuple[nn.Parameter, list[tuple[str, str]]]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                refs.setdefault(id(param), (param, []))[1].append((module_name, attr))
    for param, locations in refs.values():
        chains = [enclosing_units(module_name) for module_name, _ in locations]
        common = next(u for u in chains[0] if all(u in chain for chain in chains[1:]))
        common.params.append((param, _dedupe(locations)))
    return [plan for plan in plans if plan.params] + [root_plan]


def _dedupe(locations: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(locations))


def root_heavy_warning(root: nn.Module, plans: list[UnitPlan]) -> Optional[str]:
    """A warning when the root unit holds most of the parameters: under ``full`` sharding they stay gathered
    for the whole step, so sharding saves little memory. ``None`` when the plan is fine."""
    root_plan = plans[-1]
    total = sum(plan.numel() for plan in plans)
    if total == 0 or root_plan.numel() * 2 <= total:
        return None
    largest = sorted(root_plan.params, key=lambda entry: entry[0].numel(), reverse=True)[:3]
    named = ", ".join(f"{_qualified(*locations[0])} ({param.numel():,})" for param, locations in largest)
    message = (f"lightning_shard: the root unit holds {root_plan.numel() / total:.0%} of {type(root).__name__}'s"
               f" {total:,} parameters (largest: {named}); they stay gathered on every rank for the whole step, so"
               f" sharding saves little memory.")
    param, locations = largest[0]
    readers = list(dict.fromkeys(module_name for module_name, _ in locations))
    if len(readers) > 1:
        return (f"{message} The largest is one parameter tied between {readers}: it stays in the root unit"
                f" whatever the plan (untie it to shard it).")
    return f"{message} {_suggestion(root, plans, readers[0], root_plan.numel() / total)}"


def _suggestion(root: nn.Module, plans: list[UnitPlan], reader: str, share: float) -> str:
    """A ``units=[...]`` that takes the largest root parameter out, if one cuts the root's share."""
    generic = "Cut the model into units with `units=[...]` (module classes or class names) or `unit_size=`."
    members = [m for plan in plans[:-1] for m in plan.members]
    enclosing = _outermost_free_module(root, reader, members)
    if enclosing is None:
        return generic
    classes = [enclosing, *_class_names(plans[:-1], root)]
    new_plans = plan_units(root, units=classes)
    new_share = new_plans[-1].numel() / sum(plan.numel() for plan in new_plans)
    if new_share > share - 0.1:
        return generic
    matched = [name for name, m in root.named_modules() if type(m).__name__ == enclosing]
    shown = ", ".join(matched[:4]) + (", ..." if len(matched) > 4 else "")
    return (f"E.g. `units={classes}` leaves {new_share:.0%} in the root; {enclosing!r} matches {shown}, and a unit's"
            f" parameters are gathered when one of its modules is called (a weight read directly from outside it"
            f" gathers it too, kept to the end of backward). Or set `unit_size=` (a parameter budget per unit).")


def _qualified(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _outermost_free_module(root: nn.Module, module_name: str, unit_members: list[str]) -> Optional[str]:
    """The class name of the outermost module enclosing ``module_name`` that is no container and holds no unit
    (making it a unit takes the parameter out of the root without swallowing the others); None if there is none."""
    parts = module_name.split(".") if module_name else []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = root.get_submodule(name)
        holds_unit = any(m == name or m.startswith(name + ".") for m in unit_members)
        if not isinstance(module, _CONTAINERS) and not holds_unit:
            return type(module).__name__
    return None


def _class_names(plans: list[UnitPlan], root: nn.Module) -> list[str]:
    return list(dict.fromkeys(type(root.get_submodule(m)).__name__ for plan in plans for m in plan.members))
