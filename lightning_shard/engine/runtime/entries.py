"""Where a call enters the model: the root (the LightningModule, whose ``*_step`` or forward is a step's scope) or a
module below it that holds the root unit's parameters, or holds one that does (a callback's ``self.model.generate``
in ``on_train_epoch_end``, an HF model called after fit). Entered below the root outside any step, the call is a
scope of its own, as a call of the root is: the root unit is gathered for it and freed after. Inside a step or a
backward (a recomputation) these hooks only count."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from lightning_shard.engine.runtime.arguments import cast_floating, flatten_arguments, in_backward, needs_cast
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
    """Mixed into ShardRuntime (its step state: ``_depth``, ``_final_callback_queued``, ``_steps_driven``)."""

    root: nn.Module
    root_unit: Optional[Unit]
    _handles: list[Any]

    def _install_root_unit_hooks(self, eager: Callable) -> None:
        assert self.root_unit is not None
        self._entries: list[bool] = []  # per call entered below the root: whether it opened a scope
        # the root unit's own modules get their inputs in param_dtype too
        owners = list({id(module): module for slot in self.root_unit.storage.slots
                       for module, _ in slot.locations}.values())
        for owner in owners:
            self._handles.append(owner.register_forward_pre_hook(
                eager(lambda m, a, k, u=self.root_unit: self._root_module_pre_forward(u, a, k)), with_kwargs=True))
        for module in entry_modules(self.root, owners):  # before and after every other hook of the module
            self._handles.append(module.register_forward_pre_hook(eager(lambda m, a: self._enter_below_root()),
                                                                  prepend=True))
            self._handles.append(module.register_forward_hook(eager(lambda m, a, out: self._exit_below_root(out)),
                                                              always_call=True))

    def _enter_below_root(self) -> None:
        # outside a step, and not a recomputation inside backward (a backward that raised left its flag: the scope
        # opened here recovers from it, as a call of the root does)
        opens = self.state.depth == 0 and (not self.state.backward_running or not in_backward())
        self._entries.append(opens)  # first: an error entering still pops it as the call ends
        if opens:
            self._enter_step(step=not self._steps_driven)

    def _exit_below_root(self, output: Any) -> None:
        # (empty where a hook of the user's that runs before ours raised: the call never reached our pre-hook)
        if self._entries and self._entries.pop():
            self._exit_step(output)

    def _root_module_pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        self._follow_requires_grad(unit)
        if not needs_cast(unit):
            return None
        flat, rebuild = flatten_arguments(args, kwargs)
        return rebuild(cast_floating(flat, unit.storage.param_dtype))
