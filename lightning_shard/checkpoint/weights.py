"""Weights copied into a sharded model from a source (``sources.py``: a state dict, a torch or safetensors
file, an HF folder), each rank reading only the slices its shards own: no rank ever holds the whole model."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX, _IncompatibleKeys

from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.quantized_load import fits_packed, is_unquantized, load_packed, underlying
from lightning_shard.engine.runtime.hooks import ShardRuntime


@torch.no_grad()
def load_into(runtime: ShardRuntime, source: Any, strict: bool = True, prefix: str = "",
              not_expected: Optional[Callable[[str], bool]] = None) -> tuple[list[str], list[str]]:
    """Copy ``source`` (``sources.py``) into the sharded model; model name = ``prefix`` + source name. Returns
    (missing, unexpected) like ``load_state_dict``; with ``strict`` either raises, as does any shape mismatch.
    ``not_expected(name)``: a model name the source is not meant to hold, never missing (a peft model's
    adapter weights, when loading its base model's folder).

    The names go through the model's load pre-hooks first, as in ``nn.Module.load_state_dict`` (see
    ``_KeyWalk``), so a state dict of the plain model loads whatever its hooks rename. Nothing is copied
    before every name and shape has been checked (but by a module without sharded parameters that loads
    itself, as it would unsharded). Tied weights need only one of their names.
    """
    slots = [(unit, slot, param) for unit in runtime.units
             for slot, param in zip(unit.storage.slots, unit.storage.shard_params)]
    walk = _KeyWalk(slots, source, prefix, strict)
    walk.load(runtime.root, walk.initial(), "")
    missing, unexpected = walk.incompatible()
    unexpected = [name for name in unexpected if not walk.packed_state(name)]
    if not_expected is not None:
        missing = [name for name in missing if not not_expected(name)]
    if strict and (missing or unexpected):
        raise CheckpointError(f"The weights do not fit the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''},"
                              f" unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}.")
    if walk.mismatched or walk.errors:
        raise CheckpointError(" ".join(walk.mismatched[:8]) + (" Loading failed: " + "; ".join(walk.errors)
                                                               if walk.errors else ""))
    for i, (key, value) in walk.params.items():
        unit, slot, param = slots[i]
        param.copy_(walk.read(value, *unit.storage.param_range(slot, unit.storage.rank)))
    if walk.packed:  # 4-bit weights: quantized by parts, or pre-quantized with their state (every rank: collectives)
        load_packed(runtime, walk, walk.packed, slots)
    for buffer, value in walk.buffers:
        buffer.copy_(walk.whole(value))
    for module, value in walk.extra_states:
        module.set_extra_state(walk.whole(value) if isinstance(value, Tensor) else value)
    runtime.refresh_gathered()
    return missing, unexpected


# torch's BatchNorm / InstanceNorm loaders: they only fill in or drop buffer keys of checkpoints from old torch
# versions, then load as nn.Module does; walked as nn.Module's (without those fixes), not refused
_TORCH_LOADERS = {_NormBase._load_from_state_dict, _InstanceNorm._load_from_state_dict}


class _KeyWalk:
    """``nn.Module.load_state_dict``'s walk over the module tree, minus the copies: per module, in the same
    order and with the same prefix and per-module dict, its load pre-hooks rename (or recompute) the keys,
    then its own parameters, persistent buffers and extra state take the values under their names, and its
    load post-hooks see the missing and unexpected keys. What is found is copied afterwards, each rank
    reading only the slices its shards own.

    A lazily read file (safetensors) goes through the hooks as meta tensors of the right shape and dtype,
    traced back to the file by identity; a hook that computes a new value from one cannot be honoured and is
    named in the error. A module that owns sharded parameters and loads them in its own
    ``_load_from_state_dict`` is refused, naming it; one holding no sharded parameter runs its own.
    """

    def __init__(self, slots: list, source: Any, prefix: str, strict: bool) -> None:
        self.source, self.prefix, self.strict = source, prefix, strict  # the hooks get `strict` as load_state_dict's do
        self.slot_at = {(id(module), attr): i for i, (_, slot, _) in enumerate(slots)
                        for module, attr in slot.locations}
        self.slot_names = [slot.names for _, slot, _ in slots]
        self.shapes = [slot.shape for _, slot, _ in slots]
        self.slots = [slot for _, slot, _ in slots]
        self.metadata = source.metadata
        self.origin: dict[int, str] = {}  # id(value as given to the hooks) -> the source's name
        self.kept: list[Any] = []  # those values, alive so that their ids stay theirs
        self.made_by: dict[int, str] = {}  # id(a meta value a hook computed) -> the hook, named
        self.params: dict[int, tuple[str, Any]] = {}  # slot index -> (key, value), first found
        self.quant = [getattr(slot, "quant", None) for _, slot, _ in slots]  # a packed 4-bit weight's quantization
        self.packed: dict[int, tuple[str, Any]] = {}  # those of them found (quantized_load.py reads them)
        self.buffers: list[tuple[Tensor, Any]] = []
        self.extra_states: list[tuple[nn.Module, Any]] = []
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.errors: list[str] = []  # as torch's error_msgs: hooks may add to them
        self.mismatched: list[str] = []

    def initial(self) -> dict[str, Any]:
        state = {}
        for name in self.source.names():
            value = self.source.value(name)
            self.origin[id(value)] = name
            self.kept.append(value)
            state[self.prefix + name] = value
        return state

    # -- the walk ---------------------------------------------------------------------------------------
    def load(self, module: nn.Module, local: dict[str, Any], mprefix: str) -> None:
        name = mprefix[:-1]
        local_metadata = self._local_metadata(mprefix)
        owns = [attr for attr in module._parameters if (id(module), attr) in self.slot_at]
        loader = type(module)._load_from_state_dict
        if loader is not nn.Module._load_from_state_dict and loader not in _TORCH_LOADERS:
            if owns:
                raise CheckpointError(
                    f"Module {name or '<root>'!r} ({type(module).__name__}) overrides _load_from_state_dict and owns"
                    f" sharded parameters {owns}: a sharded load cannot run it. Rename or convert its keys in a"
                    " load pre-hook instead (module.register_load_state_dict_pre_hook), which loading honours."
                )
            for key, value in list(local.items()):  # its own state, whole (buffers and such: small)
                if key.startswith(mprefix) and "." not in key[len(mprefix):] and isinstance(value, Tensor):
                    local[key] = self.whole(value)
            module._load_from_state_dict(local, mprefix, local_metadata, self.strict, self.missing, self.unexpected,
                                         self.errors)
        else:
            for hook in module._load_state_dict_pre_hooks.values():
                hook(local, mprefix, local_metadata, self.strict, self.missing, self.unexpected, self.errors)
                self._note_computed(local, name, hook)
            self._take_own(module, local, mprefix)
        for child_name, child in module._modules.items():
            child_prefix = mprefix + child_name + "."
            if child is not None and (child_prefix.startswith(self.prefix) or self.prefix.startswith(child_prefix)):
                self.load(child, {k: v for k, v in local.items() if k.startswith(child_prefix)}, child_prefix)
        incompatible = _IncompatibleKeys(self.missing, self.unexpected)
        for hook in module._load_state_dict_post_hooks.values():
            if hook(module, incompatible) is not None:
                raise CheckpointError(f"The load_state_dict post-hook {_hook_name(hook)} of module"
                                      f" {name or '<root>'!r} returned a value; it must edit the key lists in place.")

    def _take_own(self, module: nn.Module, local: dict[str, Any], mprefix: str) -> None:
        """``nn.Module._load_from_state_dict`` after its pre-hooks, recording instead of copying."""
        own = {attr for attr, p in module._parameters.items() if p is not None}
        for attr in (attr for attr in module._parameters if attr in own):
            key = mprefix + attr
            i = self.slot_at.get((id(module), attr))
            if key not in local:
                self.missing.append(key)
            elif i is None:  # a parameter of no unit: not expected from shard_module
                self.errors.append(f"{key!r} is a parameter of no sharded unit")
            elif self.quant[i] is not None:  # a 4-bit weight: full precision or packed
                if self._packed(key, local[key], i):
                    self.packed.setdefault(i, (key, local[key]))
            elif self._check(key, local[key], self.shapes[i]) and i not in self.params:
                self.params[i] = (key, local[key])
        for attr, buffer in module._buffers.items():
            if buffer is None or attr in module._non_persistent_buffers_set:
                continue
            own.add(attr)
            key = mprefix + attr
            if key not in local:
                self.missing.append(key)
            elif self._check(key, local[key], buffer.shape):
                self.buffers.append((buffer, local[key]))
        extra = mprefix + _EXTRA_STATE_KEY_SUFFIX
        if getattr(type(module), "set_extra_state", nn.Module.set_extra_state) is not nn.Module.set_extra_state:
            if extra in local:
                self.extra_states.append((module, local[extra]))
            else:
                self.missing.append(extra)
        elif extra in local:
            self.unexpected.append(extra)
        for key in local:
            if key.startswith(mprefix) and key != extra:
                first, *rest = key[len(mprefix):].split(".", 1)
                if (rest and first not in module._modules) or (not rest and first not in own):
                    self.unexpected.append(key)

    def _check(self, key: str, value: Any, shape: torch.Size) -> bool:
        if not isinstance(value, Tensor):
            self.errors.append(f"{key!r} is a {type(value).__name__}, not a tensor")
            return False
        if value.is_meta and id(value) not in self.origin:
            raise CheckpointError(
                f"{key!r} was computed by {self.made_by.get(id(value), 'a load_state_dict pre-hook')} from weights"
                " read lazily (safetensors); such a hook needs the tensors themselves: load the file into a state"
                " dict first (e.g. safetensors.torch.load_file) and pass that."
            )
        if value.shape != shape:
            self.mismatched.append(f"Shape mismatch for {key!r}: weights {tuple(value.shape)}, model {tuple(shape)}.")
            return False
        return True

    def _note_computed(self, local: dict[str, Any], name: str, hook: Any) -> None:
        for value in local.values():
            if isinstance(value, Tensor) and value.is_meta and id(value) not in self.origin:
                if id(value) not in self.made_by:
                    self.kept.append(value)
                    self.made_by[id(value)] = f"the load_state_dict pre-hook {_hook_name(hook)} of module {name or '<root>'!r}"

    def _local_metadata(self, mprefix: str) -> dict[str, Any]:
        if self.metadata is None or not mprefix.startswith(self.prefix):
            return {}
        return dict(self.metadata.get(mprefix[len(self.prefix):-1], {}))

    def incompatible(self) -> tuple[list[str], list[str]]:
        """Missing and unexpected names (the unexpected ones as the source spells them, less ``prefix``); a tied
        weight found under one of its names is not missing under the others."""
        found = {key for i in (*self.params, *self.packed) for key in self.slot_names[i]}
        missing = list(dict.fromkeys(k for k in self.missing if k.startswith(self.prefix) and k not in found))
        unexpected = list(dict.fromkeys(k[len(self.prefix):] if k.startswith(self.prefix) else k
                                        for k in self.unexpected))
        return missing, sorted(unexpected)

    def _packed(self, key: str, value: Any, i: int) -> bool:
        """A 4-bit weight of the model found: full precision (to quantize) or pre-quantized; else a mismatch."""
        if isinstance(value, Tensor) and (is_unquantized(value, self.quant[i]) or fits_packed(value, self.slots[i])):
            return True
        shape = getattr(value, "shape", None)
        self.mismatched.append(f"Shape mismatch for {key!r}: weights {tuple(shape) if shape is not None else value!r},"
                               f" model a 4-bit weight of {tuple(self.quant[i].shape)}"
                               f" (packed {tuple(self.shapes[i])}).")
        return False

    def packed_state(self, name: str) -> bool:
        """Whether ``name`` (as unexpected reports it) is a found 4-bit weight's quantization state."""
        weights = {underlying(self, value)[1] for _, value in self.packed.values()}  # as the files name them
        name = underlying(self, None, name)[1]
        for suffix in ("absmax", "quant_map", "nested_absmax", "nested_quant_map",
                       "quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4"):
            if name.endswith("." + suffix) and name[: -len(suffix) - 1] in weights:
                return True
        return False

    # -- reading what was found -------------------------------------------------------------------------
    def read(self, value: Tensor, lo: int, hi: int) -> Tensor:
        name = self.origin.get(id(value))
        return self.source.read(name, lo, hi) if name is not None else value.reshape(-1)[lo:hi]

    def whole(self, value: Tensor) -> Tensor:
        name = self.origin.get(id(value))
        return self.source.whole(name) if name is not None else value


def _hook_name(hook: Any) -> str:
    hook = getattr(hook, "hook", hook)  # torch wraps hooks registered with the module
    return repr(getattr(hook, "__qualname__", None) or type(hook).__name__)
