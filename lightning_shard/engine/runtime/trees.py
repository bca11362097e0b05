"""A call's arguments or outputs as one flat list of leaves, and how to rebuild them: torch's pytree, and inside
dataclasses that pytree does not know, as FSDP2 walks them (``torch.distributed.utils._apply_to_tensors``). A unit
taking or returning a plain ``@dataclass`` then has the tensors inside seen by the hooks that gather it for its
backward and reduce its gradients (unseen, its backward read freed parameters)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten


def flatten(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """``tree``'s leaves, dataclasses opened, and a function rebuilding ``tree`` from leaves in their place."""
    flat, spec = tree_flatten(tree)
    if not any(_is_dataclass_instance(x) for x in flat):
        return flat, lambda values: tree_unflatten(values, spec)
    leaves: list = []
    parts: list[tuple[int, int, Any, Callable[[list], Any]]] = []  # (start, count, dataclass or None, its rebuild)
    for leaf in flat:
        if _is_dataclass_instance(leaf):
            fields, rebuild_fields = flatten([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
            parts.append((len(leaves), len(fields), leaf, rebuild_fields))
            leaves.extend(fields)
        else:
            parts.append((len(leaves), 1, None, _first))
            leaves.append(leaf)

    def rebuild(values: list) -> Any:
        top = [rebuild_part(values[start:start + count]) if instance is None
               else _replaced(instance, rebuild_part(values[start:start + count]))
               for start, count, instance, rebuild_part in parts]
        return tree_unflatten(top, spec)

    return leaves, rebuild


def leaves(tree: Any) -> list:
    """``tree``'s leaves, dataclasses opened."""
    return flatten(tree)[0]


def output_leaves(output: Any) -> list:
    """``output``'s leaves, dataclasses and plain objects opened (:func:`is_plain_object`: their attributes), each
    object once: what a unit returns, read only (a call's arguments are not opened: a cache object passed in is the
    caller's to keep)."""
    found: list = []
    seen: set[int] = set()

    def visit(tree: Any) -> None:
        for leaf in leaves(tree):
            if is_plain_object(leaf):
                if id(leaf) not in seen:
                    seen.add(id(leaf))
                    visit(list(vars(leaf).values()))
            else:
                found.append(leaf)

    visit(output)
    return found


def is_plain_object(x: Any) -> bool:
    """An instance of a class that pytree and dataclasses do not open, holding its values as attributes: a unit may
    return its tensors inside one (``Holder(out=out, bias=self.bias)``, DeepSpeed's test_ext_param_returnobj)."""
    return (hasattr(x, "__dict__") and not isinstance(x, (Tensor, nn.Module, type)) and not callable(x)
            and not _is_dataclass_instance(x))


def _first(values: list) -> Any:
    return values[0]


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _replaced(instance: Any, values: list) -> Any:
    """``instance`` with its fields' new values: itself where none changed (a module may test identity), else a copy
    made by ``dataclasses.replace`` (fields outside ``__init__`` set on the copy)."""
    fields = dataclasses.fields(instance)
    if all(getattr(instance, f.name) is v for f, v in zip(fields, values)):
        return instance
    copy = dataclasses.replace(instance, **{f.name: v for f, v in zip(fields, values) if f.init})
    for f, v in zip(fields, values):
        if not f.init:
            object.__setattr__(copy, f.name, v)
    return copy
