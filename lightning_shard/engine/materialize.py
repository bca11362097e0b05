"""Bring a model built on the meta device to life one unit at a time, so that no rank ever holds more than
its shards plus one unit.

A unit's meta tensors get real (uninitialised) storage, then each module owning one of them runs its
``reset_parameters()``: torch's convention for a module re-initialising *its own* parameters and
buffers. Ties survive: a tied parameter is replaced under every name that registers it. The caller shards
the unit right away, and its full tensors go with the last reference.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from lightning_shard.engine.plan import UnitPlan


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

    @staticmethod
    def has_meta(module: nn.Module) -> bool:
        return any(t is not None and t.is_meta for t in (*module.parameters(), *module.buffers()))

    def unit(self, plan: UnitPlan) -> None:
        """Materialise the modules owning ``plan``'s parameters; ``plan.params`` then holds the real ones."""
        if not any(param.is_meta for param, _ in plan.params):
            return
        for module_name, attr in (loc for _, locations in plan.params for loc in locations):
            self._reset(self.root.get_submodule(module_name))
        plan.params[:] = [(getattr(self.root.get_submodule(locations[0][0]), locations[0][1]), locations)
                          for _, locations in plan.params]

    def leftover_buffers(self) -> None:
        """Buffers of modules owning no parameters (e.g. a parameter-free module's fixed table)."""
        for module in self.root.modules():
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                if any(p is not None for p in module._parameters.values()):
                    continue  # reset with its parameters already
                self._reset(module)

    def _reset(self, module: nn.Module) -> None:
        if id(module) in self.done:
            return
        self.done.add(id(module))
        meta = [n for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None and t.is_meta]
        if not meta:
            return
        # torch's MultiheadAttention spells it `_reset_parameters`
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"Cannot materialise module {self.names.get(id(module))!r} ({type(module).__name__}) from the meta"
                f" device: its {meta} have no values and it has no `reset_parameters()` to initialise them. Define"
                " `reset_parameters()` (initialising the module's own parameters and buffers), or build this module"
                " on a real device."
            )
        with torch.no_grad():
            for attr, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    real = nn.Parameter(torch.empty_like(param, device=self.device), requires_grad=param.requires_grad)
                    for owner, owner_attr in self.owners[id(param)]:
                        owner._parameters[owner_attr] = real
                    self.owners[id(real)] = self.owners.pop(id(param))
            for attr, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    module._buffers[attr] = torch.empty_like(buffer, device=self.device)
            reset()
