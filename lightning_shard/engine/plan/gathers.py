"""In which dtype each parameter is gathered, and computed with, under mixed precision.

``cast_params="all"`` (FSDP's ``MixedPrecision``): every floating parameter in ``param_dtype``. ``"autocast"`` (what
``precision="bf16-mixed"`` and ``"16-mixed"`` take): only the parameters autocast would cast to ``param_dtype``
anyway, those read by its lower-precision ops alone (linear, convolution, matmul: the weights and biases of
``nn.Linear``, ``nn.ConvNd``, ``nn.ConvTransposeNd``, transformers' ``Conv1D``); every other one in its own dtype
(embeddings, norms, a tied embedding and head, parameters a module reads in its own way). A forward under autocast
then computes what DDP under autocast computes, bit for bit: the cast autocast would make is the gathered value, and
what it would leave in float32 (an embedding's output, the residual stream built from it, the norms) stays so.
``"auto"`` (the precisions' default) does so where it costs nothing: in a unit of several dtypes already (LoRA on a
bf16 base, QLoRA's 4-bit layers) or one that trains nothing (a frozen base, QLoRA's embeddings and head); a unit whose
parameters all train in one dtype (full fine-tuning) gathers every one in ``param_dtype``, as ``"all"``: its gathers of
two dtypes would make it a unit of several dtypes (storage/mixed_shard.py), whose layout costs a rank a bf16 copy of
its shard and places whole parameters on ranks, and has no overlapped offload step or weight averaging yet.

Decided at setup from where each parameter is registered and which code reads it: a module whose class overrides
its ``forward`` (a weight-standardised convolution) or whose weight another module reads for itself (peft's DoRA reads
its base layer's weight for a norm) keeps its own dtype. A module reading another's parameter through an op of its
own is not seen: docs/precision.md says what to do then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

CASTS = ("all", "autocast", "auto")
# classes whose forward reads ``weight`` and ``bias`` only through ops autocast computes in its lower dtype
_LOWER = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_LOWER_FORWARDS = {cls.forward for cls in _LOWER}


def validate_cast_params(cast_params: object) -> str:
    if cast_params not in CASTS:
        raise ValueError(f"`cast_params` must be one of {', '.join(map(repr, CASTS))} (which parameters are gathered"
                         f" in param_dtype: every floating one, those autocast casts to it, or those where that costs"
                         f" nothing), got {cast_params!r}.")
    return cast_params  # type: ignore[return-value]


@dataclass
class GatherDtypes:
    """The gather dtype of each parameter of ``root`` (a model not sharded yet) under ``param_dtype``."""

    root: nn.Module
    param_dtype: Optional[torch.dtype]
    cast_params: str = "all"
    _read_elsewhere: Optional[set[int]] = field(default=None, repr=False)

    def of(self, param: torch.Tensor, locations: list[tuple[str, str]]) -> torch.dtype:
        """``locations``: every (module name, attribute) registering ``param``."""
        if self.param_dtype is None or not param.is_floating_point():
            return param.dtype
        if self.cast_params == "all" or all(self._autocast_casts(name, attr) for name, attr in locations):
            return self.param_dtype
        return param.dtype

    def by_parameter(self, plans: list) -> dict[int, torch.dtype]:
        """id(parameter) -> its gather dtype, units resolved (``plans``: the planner's units)."""
        return {id(param): unit.of(param, locations) for plan in plans
                for unit in [self.for_unit([p for p, _ in plan.params])] for param, locations in plan.params}

    def for_unit(self, params: list[torch.Tensor]) -> "GatherDtypes":
        """The gathers of a unit of ``params``: ``"auto"`` resolved (see the module note)."""
        if self.cast_params != "auto":
            return self
        several = len({p.dtype for p in params}) > 1  # (a 4-bit weight's packed bytes are uint8)
        if several or not any(p.requires_grad for p in params):
            return GatherDtypes(self.root, self.param_dtype, "autocast", self._readers())
        return GatherDtypes(self.root, self.param_dtype, "all")

    def _autocast_casts(self, module_name: str, attr: str) -> bool:
        module = self.root.get_submodule(module_name)
        if attr not in ("weight", "bias") or id(module) in self._readers():
            return False
        cls = type(module)
        if cls.forward in _LOWER_FORWARDS:
            return True
        library = cls.__module__.split(".")[0]
        # transformers' Conv1D (GPT-2) is torch.addmm; bitsandbytes casts a 4-bit layer's bias to its compute dtype
        return (library == "transformers" and cls.__name__ == "Conv1D") or (
            library == "bitsandbytes" and cls.__name__ == "Linear4bit" and attr == "bias")

    def _readers(self) -> set[int]:
        """Modules whose weight another reads for itself: the base layers of peft's DoRA layers (a norm of it)."""
        if self._read_elsewhere is None:
            self._read_elsewhere = set()
            for module in self.root.modules():
                if any(getattr(module, "use_dora", {}).values()) and hasattr(module, "get_base_layer"):
                    self._read_elsewhere.add(id(module.get_base_layer()))
        return self._read_elsewhere
