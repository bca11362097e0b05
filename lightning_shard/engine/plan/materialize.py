"""Bring a model built on the meta device to life one unit at a time, so that no rank ever holds more than
its shards plus one unit.

For each unit, in two steps:

1. *Module-level*: the unit's meta tensors get real (uninitialised) storage, and each module owning one of
   them runs its ``reset_parameters()`` (torch's convention for a module re-initialising *its own*
   parameters and buffers) -- unless the module also owns parameters through its children: then its
   ``reset_parameters()`` is a model-level init, below.
2. *Model-level* (torchtitan's convention): every module whose subtree holds one of the unit's freshly
   materialised parameters and that defines ``init_weights()`` -- or ``reset_parameters()`` while owning
   parameters through children (e.g. ``GPT.reset_parameters`` walking ``named_parameters()``) -- runs it,
   innermost first and the outermost last, as their constructors would have. Every parameter *not*
   materialised in this step (other units' shards, units still on meta, parameters that were real from the
   start) is meanwhile replaced by a meta placeholder of its original shape: init ops on meta tensors are
   no-ops that draw no random numbers, so the init takes effect on exactly this unit's new parameters, the
   same way whatever the world size. The model-level init therefore runs once per unit it encloses (and once
   more for meta buffers left over at the end), and never touches a parameter that was not on meta (real
   buffers it sets are set again, to the same values for a deterministic init).

A module's ``init_weights`` that needs arguments (torchtitan's ``Attention.init_weights(init_std)``) is
left to the enclosing no-argument init that calls it; with none, setup refuses. It also refuses an init
that replaces a parameter instead of initialising it in place, or fails on the placeholders (``copy_``
or ``.item()`` of another unit's parameter). Not detected, so not supported: an init reading another unit's
values in a way meta tensors let through silently (``p.add_(other)`` is a no-op), one that checks
``is_meta``, or one that remembers it has run (e.g. a flag): it would take effect on the first unit only
(HF transformers' ``_is_hf_initialized`` module flags are cleared before each run). A parameter no init
wrote (it starts as NaN) is refused, naming it.
Values are not bit-identical to building on a real device with the same seed (the random numbers are drawn
in a different order), only identically distributed.

Ties survive: a tied parameter is replaced under every name that registers it. The caller shards the unit
right away, and its full tensors go with the last reference.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Callable, Optional

import torch
from torch import nn

from lightning_shard.engine.plan.plan import UnitPlan


class Materializer:
    def __init__(self, root: nn.Module, device: torch.device) -> None:
        self.root, self.device = root, device
        # every (module, attribute) registering each parameter: ties must stay ties
        self.owners: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
        for module in root.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    self.owners[id(param)].append((module, attr))
        self.names = {id(m): name or "<root>" for name, m in root.named_modules(remove_duplicate=False)}
        self.done: set[int] = set()
        # every (module, attribute, meta placeholder of the original parameter), one placeholder per tie
        self.locations: list[tuple[nn.Module, str, nn.Parameter]] = []
        for locations in self.owners.values():
            param = locations[0][0]._parameters[locations[0][1]]
            placeholder = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            self.locations += [(module, attr, placeholder) for module, attr in locations]
        # model-level inits, innermost first; `covered`: modules some model-level init encloses
        self.model_level: list[tuple[nn.Module, str]] = []
        self.covered: set[int] = set()
        needs_args = []
        for module in _post_order(root):
            name = _model_level_init(module)
            if name is None:
                continue
            if _needs_args(getattr(module, name)):
                needs_args.append((module, name))  # the enclosing init calls it, with its arguments
                continue
            self.model_level.append((module, name))
            self.covered.update(id(m) for m in module.modules())
        for module, name in reversed(needs_args):  # the outermost first: the one to fix
            if id(module) not in self.covered and self.has_meta(module):
                raise ValueError(
                    f"Cannot materialise module {self.names.get(id(module))!r} ({type(module).__name__}) from the meta"
                    f" device: its `{name}{inspect.signature(getattr(module, name))}` needs arguments, so only an"
                    " enclosing module's init can call it, and no enclosing module defines an `init_weights()` or"
                    " `reset_parameters()` callable without arguments. Give the arguments defaults, define"
                    " `init_weights()` on an enclosing module (e.g. the root) that calls it, or build the model on a"
                    " real device."
                )

    @staticmethod
    def has_meta(module: nn.Module) -> bool:
        return any(t is not None and t.is_meta for t in (*module.parameters(), *module.buffers()))

    def unit(self, plan: UnitPlan) -> None:
        """Materialise the modules owning ``plan``'s parameters; ``plan.params`` then holds the real ones."""
        if not any(param.is_meta for param, _ in plan.params):
            return
        was_meta = [param.is_meta for param, _ in plan.params]
        for module_name, attr in (loc for _, locations in plan.params for loc in locations):
            self._reset(self.root.get_submodule(module_name))
        plan.params[:] = [(getattr(self.root.get_submodule(locations[0][0]), locations[0][1]), locations)
                          for _, locations in plan.params]
        fresh = {id(param) for (param, _), meta in zip(plan.params, was_meta) if meta}
        self._run_model_level([(m, name) for m, name in self.model_level
                               if any(id(p) in fresh for p in m.parameters())], fresh)
        unset = [".".join(filter(None, locations[0])) for param, locations in plan.params
                 if id(param) in fresh and param.is_floating_point() and bool(torch.isnan(param).any())]
        if unset:
            raise ValueError(
                f"Cannot materialise {unset[:4]} from the meta device: no init wrote (all of) them. Their module has"
                " no `reset_parameters()`, and the model-level init enclosing it leaves them as they were. Initialise"
                " them there, give their module a `reset_parameters()`, or build the model on a real device."
            )

    def leftover_buffers(self) -> None:
        """Buffers of modules owning no parameters (e.g. a parameter-free module's fixed table)."""
        materialised = set()
        for module in _post_order(self.root):
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                if any(p is not None for p in module._parameters.values()):
                    continue  # reset with its parameters already
                self._reset(module)
                materialised.add(id(module))
        # the model-level inits enclosing them may set them too (torchtitan's `freqs_cis`): every parameter is
        # a placeholder meanwhile, as no parameter is new here
        self._run_model_level([(m, name) for m, name in self.model_level
                               if any(id(sub) in materialised for sub in m.modules())], fresh=set())

    def _reset(self, module: nn.Module) -> None:
        if id(module) in self.done:
            return
        self.done.add(id(module))
        meta = [n for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None and t.is_meta]
        if not meta:
            return
        # a module owning parameters through children too runs its reset as a model-level init, after theirs
        reset_name = None if _owns_through_children(module) else _own_reset(module)
        reset = getattr(module, reset_name) if reset_name else None
        if reset is None and id(module) not in self.covered:
            raise ValueError(
                f"Cannot materialise module {self.names.get(id(module))!r} ({type(module).__name__}) from the meta"
                f" device: its {meta} have no values and it has no `reset_parameters()` to initialise them. Define"
                " `reset_parameters()` (initialising the module's own parameters and buffers), or an `init_weights()`"
                " on it or an enclosing module, or build this module on a real device."
            )
        with torch.no_grad():
            for attr, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    real = nn.Parameter(_unwritten(param, self.device), requires_grad=param.requires_grad)
                    for owner, owner_attr in self.owners[id(param)]:
                        owner._parameters[owner_attr] = real
                    self.owners[id(real)] = self.owners.pop(id(param))
            for attr, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    module._buffers[attr] = torch.empty_like(buffer, device=self.device)
            if reset is not None:
                reset()

    def _run_model_level(self, inits: list[tuple[nn.Module, str]], fresh: set[int]) -> None:
        """Run ``inits`` with every parameter not in ``fresh`` replaced by its meta placeholder."""
        if not inits:
            return
        kept = []  # (module, attr, registered parameter, what the inits must leave registered)
        for module, attr, placeholder in self.locations:
            param = module._parameters[attr]
            expected = param if id(param) in fresh else placeholder
            module._parameters[attr] = expected
            kept.append((module, attr, param, expected))
        for module, _ in inits:  # HF's init skips a module it marked as done: each unit's run is a first run
            for submodule in module.modules():
                submodule.__dict__.pop("_is_hf_initialized", None)
        try:
            with torch.no_grad():
                for module, name in inits:
                    label = f"`{type(module).__name__}.{name}()` of module {self.names.get(id(module))!r}"
                    try:
                        getattr(module, name)()
                    except Exception as error:
                        raise ValueError(
                            f"Cannot run the model-level init {label} on the meta-device model: it raised"
                            f" {type(error).__name__}: {error}. Sharding materialises the model one unit at a time"
                            " and runs this init once per unit, with every parameter outside the unit on the meta"
                            " device (no values): it must initialise each parameter in place from its shape alone"
                            " (`nn.init.*`), never reading another parameter's values. Make it so, or build the"
                            " model on a real device."
                        ) from error
                    for owner, attr, _, expected in kept:
                        if owner._parameters.get(attr) is not expected:
                            fqn = attr if owner is self.root else f"{self.names.get(id(owner))}.{attr}"
                            raise ValueError(
                                f"The model-level init {label} replaced parameter {fqn!r} instead of initialising"
                                " it in place, which sharding cannot honour on the meta device. Initialise it in place"
                                " (`nn.init.*`, `param.copy_(...)`), or build the model on a real device."
                            )
        finally:
            for owner, attr, param, _ in kept:
                owner._parameters[attr] = param


def _unwritten(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Storage for a meta parameter, NaN where floating point: what no init writes is found afterwards."""
    if param.is_floating_point():
        return torch.full_like(param, float("nan"), device=device)
    return torch.empty_like(param, device=device)


def _post_order(root: nn.Module) -> list[nn.Module]:
    """Each module once, after all its descendants: the order their constructors' inits ran in."""
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if id(module) not in seen:
            seen.add(id(module))
            for child in module.children():
                visit(child)
            order.append(module)

    visit(root)
    return order


def _owns_through_children(module: nn.Module) -> bool:
    return any(True for child in module.children() for _ in child.parameters())


def _own_reset(module: nn.Module) -> Optional[str]:
    # torch's MultiheadAttention spells it `_reset_parameters`
    return next((n for n in ("reset_parameters", "_reset_parameters") if callable(getattr(module, n, None))), None)


def _model_level_init(module: nn.Module) -> Optional[str]:
    """The name of ``module``'s model-level init, if it has one (``init_weights`` wins over a reset)."""
    if callable(getattr(module, "init_weights", None)):
        return "init_weights"
    return _own_reset(module) if _owns_through_children(module) else None


def _needs_args(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): assume it needs none
        return False
    return any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)
