"""The sharded tree used as a plain module (issue 14, item 10): a part of ``ShardRuntime``.

The tree holds 1-D shard parameters viewing each unit's flat storage. A conversion (``.half()``, ``.to()``,
``.cpu()`` ... all go through ``nn.Module._apply``) would give them new tensors that no gather reads, and
``state_dict()`` would return the shards. Both are wrapped on the modules themselves, at setup.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_shard.engine.storage.quantized import full_parameters
from lightning_shard.engine.storage.unit import Unit


class ModuleGuards:
    def __init__(self, root: nn.Module, units: list[Unit], undo: list[Callable[[], None]]) -> None:
        self.root = root
        self.units = units
        self.undo = undo  # the runtime's: what remove_hooks() restores
        self.apply_checks: Sequence[Callable[[], None]] = ()  # more reasons to refuse any conversion (the strategy's)
        self._plain_depth = 0  # inside plain_state_dict(): state_dict() returns the tree as it is
        self._full_depth = 0  # inside a guarded state_dict(): the full tensors are registered
        self._converting = False  # inside a guarded _apply, whose subtree was checked
        self._param_names: dict[int, str] = {}
        self._shard_of_gathered: dict[int, nn.Parameter] = {}

    def install(self) -> None:
        """Wrap ``_apply`` of every module of the tree (a conversion may be called on any submodule) and
        ``state_dict``, ``load_state_dict`` and ``zero_grad`` of every module that holds a sharded parameter or has
        one below it; the runtime's ``remove_hooks`` unwraps them."""
        self._param_names = {id(p): slot.names[0] for unit in self.units for slot, *params in
                             zip(unit.storage.slots, unit.storage.shard_params, unit.storage.gathered_params)
                             for p in params}
        self._shard_of_gathered = {id(gathered): shard for unit in self.units
                                   for shard, gathered in zip(unit.storage.shard_params, unit.storage.gathered_params)}
        owners = {id(module) for unit in self.units for slot in unit.storage.slots for module, _ in slot.locations}
        for module in self.root.modules():
            self._wrap(module, "_apply", self._guarded_apply)
            if any(id(m) in owners for m in module.modules()):
                self._wrap(module, "state_dict", self._guarded_state_dict)
                self._wrap(module, "load_state_dict", self._guarded_load_state_dict)
                self._wrap(module, "zero_grad", self._guarded_zero_grad)

    def _wrap(self, module: nn.Module, name: str, guard: Callable[..., Any]) -> None:
        had = module.__dict__.get(name)
        original = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return guard(module, original, *args, **kwargs)

        def restore() -> None:
            if module.__dict__.get(name) is wrapper:
                if had is None:
                    del module.__dict__[name]
                else:
                    module.__dict__[name] = had

        module.__dict__[name] = wrapper  # an instance attribute: the recursion over children finds it too
        self.undo.append(restore)

    def _guarded_apply(self, module: nn.Module, original: Callable[..., Any], fn: Callable[[Tensor], Any],
                       *args: Any, **kwargs: Any) -> Any:
        if self._converting:  # a submodule of a conversion already checked
            return original(fn, *args, **kwargs)
        for check in self.apply_checks:
            check()
        recurse = kwargs.get("recurse", args[0] if args else True)
        self._refuse_conversion(module, fn, recurse)
        self._converting = True
        try:
            return original(fn, *args, **kwargs)
        finally:
            self._converting = False

    def _refuse_conversion(self, module: nn.Module, fn: Callable[[Tensor], Any], recurse: bool) -> None:
        """``fn`` may run on the shard (or gathered) parameters only if it returns them unchanged: probed on an
        empty tensor of each of their dtypes and devices before anything is converted. ``.to(device)`` onto the
        device they are on (Lightning calls it) returns its input, so it passes."""
        kinds: dict[tuple[torch.dtype, torch.device], str] = {}
        for submodule in module.modules() if recurse else (module,):
            for param in submodule._parameters.values():
                name = self._param_names.get(id(param)) if param is not None else None
                if name is not None:
                    for tensor in (param, param.grad):
                        if tensor is not None:
                            kinds.setdefault((tensor.dtype, tensor.device), name)
        for (dtype, device), name in kinds.items():
            probe = torch.empty(0, dtype=dtype, device=device)
            out = fn(probe)
            if out is probe:
                continue
            changes = []
            if isinstance(out, Tensor) and out.dtype != dtype:
                changes.append(f"dtype {dtype} -> {out.dtype}")
            if isinstance(out, Tensor) and out.device != device:
                changes.append(f"device {device} -> {out.device}")
            change = " and ".join(changes) or "new tensors (as `.to_empty()` makes)"
            raise RuntimeError(
                f"lightning_shard: this model is sharded; converting it ({change}, parameter {name!r} first) would"
                " detach its shard parameters from the storage that gathers read, so the optimizer would update"
                " tensors the model never computes with. After sharding, `.half()`, `.float()`, `.double()`,"
                " `.bfloat16()`, `.to(dtype)`, `.to(device)`, `.cpu()`, `.cuda()` and `.to_empty()` are refused"
                " (a `.to()` that changes nothing is fine). Choose the dtypes with ShardStrategy(mixed_precision=...)"
                " or the Trainer's `precision` (shard_module: param_dtype, reduce_dtype, buffer_dtype) and let the"
                " Trainer choose the device (shard_module: `device`); or convert the model before it is sharded."
            )

    @contextmanager
    def plain_state_dict(self) -> Iterator[None]:
        """``state_dict()`` of the tree as it is: this rank's 1-D shards, or whatever the caller registered in
        their place (the checkpoint code, which gathers on every rank itself)."""
        self._plain_depth += 1
        try:
            yield
        finally:
            self._plain_depth -= 1

    def _guarded_state_dict(self, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Alone (one rank, or ``sharding="none"``) the full tensors are this rank's: ``state_dict()`` is the
        plain model's, no collective needed. Sharded over several ranks it would need every rank to gather,
        and a ``state_dict()`` called on rank 0 only would hang there: refused, naming what to call."""
        if self._plain_depth or self._full_depth:
            return original(*args, **kwargs)
        spread = [unit for unit in self.units if unit.storage.world_size > 1]
        if spread:
            raise RuntimeError(
                f"lightning_shard: `state_dict()` of a model sharded over {spread[0].storage.world_size} ranks would"
                " give this rank's 1-D shards, and the full tensors need an all-gather on every rank (called on one"
                " rank only, it would hang). Call `lightning_shard.checkpoint.full.full_state_dict(model._shard_runtime)`"
                " on every rank (rank 0 gets the full state dict) or `trainer.save_checkpoint(path)`; for this"
                " rank's shards as they are, call it inside `with model._shard_runtime.plain_state_dict():`."
            )
        held = [(owner, attr, owner._parameters[attr]) for unit in self.units for slot in unit.storage.slots
                for owner, attr in slot.locations]
        self._full_depth += 1
        try:
            for unit in self.units:
                storage = unit.storage  # each shard is its whole parameter: one rank holds all
                values = [shard.detach().view(slot.shape) for slot, shard in zip(storage.slots, storage.shard_params)]
                fulls = full_parameters(storage.slots, values, [shard.requires_grad for shard in storage.shard_params])
                for slot, full in zip(storage.slots, fulls):
                    for owner, attr in slot.locations:
                        owner._parameters[attr] = full
            return original(*args, **kwargs)
        finally:
            self._full_depth -= 1
            for owner, attr, param in held:
                owner._parameters[attr] = param

    def _guarded_zero_grad(self, module: nn.Module, original: Callable[..., Any], set_to_none: bool = True) -> None:
        """Where a unit is gathered (the step's root, the last unit between forward and backward; every unit under
        ``grad_op``), the module holds its gathered copies, whose ``.grad`` is not what the optimizer steps: the shard
        parameters' gradients are cleared alike, as DDP's one ``.grad`` would be (with what ``no_sync()`` held for
        them: reduce.py's marks)."""
        original(set_to_none)
        for param in module.parameters():
            shard = self._shard_of_gathered.get(id(param))
            if shard is not None and shard.grad is not None:
                if set_to_none:
                    shard.grad = None
                else:
                    shard.grad.zero_()

    def _guarded_load_state_dict(self, module: nn.Module, original: Callable[..., Any], *args: Any,
                                 **kwargs: Any) -> Any:
        """The module holds 1-D shards: a state dict of full tensors (the plain model's) fails torch's shape check
        against them, in torch's words, and one of shards would pair other elements on another number of ranks.
        Refused, naming what loads it; inside ``plain_state_dict()``, this rank's shards as they are."""
        if self._plain_depth:
            return original(*args, **kwargs)
        raise RuntimeError(
            "lightning_shard: `load_state_dict()` of a sharded model would copy full tensors into this rank's 1-D"
            " shards. Call `lightning_shard.checkpoint.full.load_full_state_dict(model._shard_runtime, state_dict)`"
            " on every rank (each copies the slices it owns; `strict=` as torch's), `load_pretrained` for an HF"
            " folder, or `trainer.fit(ckpt_path=...)` to resume; or load before the model is sharded (in the"
            " LightningModule's `__init__`). For this rank's shards as `state_dict()` gave them inside"
            " `plain_state_dict()`, load inside `with model._shard_runtime.plain_state_dict():`.")
