"""Where a call enters the model: the root (the LightningModule, whose ``*_step`` or forward is a step's scope) or a
module below it that holds the root unit's parameters, or holds one that does (a callback's ``self.model.generate``
in ``on_train_epoch_end``, an HF model called after fit). Entered below the root outside any step, the call is a
scope of its own, as a call of the root is: the root unit is gathered for it and freed after. Inside a step or a
backward (a recomputation) these hooks only count."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from lightning_shard.engine.runtime.arguments import cast_floating, flatten_arguments, in_backward, needs_cast
from lightning_shard.engine.runtime.step_scope import StepScope
from lightning_shard.engine.runtime.step_state import StepState
from lightning_shard.engine.storage.unit import Unit


def entry_modules(root: nn.Module, owners: list[nn.Module]) -> list[nn.Module]:
    """``owners`` and every module between them and ``root`` (not ``root`` itself), each once."""
    owner_ids = {id(m) for m in owners}
    found: dict[int, nn.Module] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if name and id(module) in owner_ids:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                above = root.get_submodule(".".join(parts[:i]))
                found.setdefault(id(above), above)
    return list(found.values())


class ModelEntries:
    """The hooks of the modules where a call may enter below the root, each call a scope of the step's (step_scope.py)
    where it enters outside one."""

    def __init__(self, root: nn.Module, root_unit: Unit, state: StepState, scope: StepScope,
                 follow_requires_grad: Callable[[Unit], None]) -> None:
        self.root = root
        self.root_unit = root_unit
        self.state = state
        self.scope = scope
        self.follow_requires_grad = follow_requires_grad  # (unit_hooks.py)
        self._entries: list[bool] = []  # per call entered below the root: whether it opened a scope

    def install(self, handles: list[Any], eager: Callable) -> None:
        """Hooks on the root unit's modules and the modules above them, their handles into ``handles``; ``eager``
        keeps each out of a compiled graph (compile.py)."""
        # the root unit's own modules get their inputs in param_dtype too
        owners = list({id(module): module for slot in self.root_unit.storage.slots
                       for module, _ in slot.locations}.values())
        for owner in owners:
            handles.append(owner.register_forward_pre_hook(
                eager(lambda m, a, k, u=self.root_unit: self._root_module_pre_forward(u, a, k)), with_kwargs=True))
        for module in entry_modules(self.root, owners):  # before and after every other hook of the module
            handles.append(module.register_forward_pre_hook(eager(lambda m, a: self._enter_below_root()),
                                                            prepend=True))
            handles.append(module.register_forward_hook(eager(lambda m, a, out: self._exit_below_root(out)),
                                                        always_call=True))

    def _enter_below_root(self) -> None:
        # outside a step, and not a recomputation inside backward (a backward that raised left its flag: the scope
        # opened here recovers from it, as a call of the root does)
        state = self.state
        opens = state.depth == 0 and (not state.backward_running or not in_backward())
        self._entries.append(opens)  # first: an error entering still pops it as the call ends
        if opens:
            self.scope.enter_root()

    def _exit_below_root(self, output: Any) -> None:
        # (empty where a hook of the user's that runs before ours raised: the call never reached our pre-hook)
        if self._entries and self._entries.pop():
            self.scope.exit_step(output)

    def _root_module_pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        self.follow_requires_grad(unit)
        if not needs_cast(unit):
            return None
        flat, rebuild = flatten_arguments(args, kwargs)
        return rebuild(cast_floating(flat, unit.storage.param_dtype))
