"""Precision: Lightning's precision strings mapped onto the engine's dtypes, autocast, a gradient scaler
whose overflow check agrees across ranks (torch's ``ShardedGradScaler``), and norm clipping that sees every shard.

| precision    | master shards, optimizer state | gathers and compute           | gradient reduction |
|--------------|--------------------------------|-------------------------------|--------------------|
| "32-true"    | fp32                           | fp32                          | fp32               |
| "bf16-mixed" | fp32                           | bf16 (cast_params="auto")     | fp32               |
| "16-mixed"   | fp32                           | fp16 (auto), scaled loss      | fp32               |
| "bf16-true"  | bf16 (no fp32 copy anywhere)   | bf16                          | bf16               |

``bf16-true`` holds half the memory of ``bf16-mixed`` (no fp32 masters) at the price of bf16 updates.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

# each rank sees only its gradient shards: this scaler all-reduces the inf/nan verdict, so all ranks skip together
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer

from lightning_shard.engine.plan.gathers import validate_cast_params
from lightning_shard.engine.runtime.backward_watch import explain_freed_parameters

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of the engine. ``None`` means: the master (shard) dtype.

    Args:
        param_dtype: dtype of the all-gather and of the parameters the modules compute with.
        reduce_dtype: dtype in which gradients are reduced across ranks (fp32 masters: fp32 by default).
        buffer_dtype: dtype buffers (e.g. BatchNorm statistics) are cast to at setup.
        cast_params: which parameters are gathered in ``param_dtype``: ``"all"`` floating ones (FSDP's mixed
            precision), or ``"autocast"``: those autocast casts to it anyway (linear, convolution weights and biases),
            the others (embeddings, norms) in their own dtype, so that a forward under autocast is DDP's, bit for
            bit; ``"auto"``: ``"autocast"`` in the units where it costs nothing (LoRA, QLoRA, a frozen base), ``"all"``
            in those that train whole (engine/plan/gathers.py). ``precision="bf16-mixed"`` and ``"16-mixed"`` take
            ``"auto"``.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    cast_params: str = "all"


def validate_mixed_precision(policy: object) -> Optional[MixedPrecision]:
    if policy is None:
        return None
    if not isinstance(policy, MixedPrecision):
        raise TypeError(f"`mixed_precision` must be a lightning_shard.MixedPrecision, got {type(policy).__name__}.")
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"`MixedPrecision.{field}` must be a floating torch.dtype or None, got {dtype!r}.")
    validate_cast_params(policy.cast_params)
    return policy


def sharded_like(scaler: torch.amp.GradScaler, device: str) -> ShardedGradScaler:
    """A ShardedGradScaler with ``scaler``'s settings and, once used, its scale and growth count."""
    if isinstance(scaler, ShardedGradScaler):
        return scaler
    sharded = ShardedGradScaler(device, init_scale=scaler._init_scale, growth_factor=scaler._growth_factor,
                                backoff_factor=scaler._backoff_factor, growth_interval=scaler._growth_interval,
                                enabled=scaler.is_enabled())
    state = scaler.state_dict()
    if state:
        sharded.load_state_dict(state)
    return sharded


_POLICY = {
    "32-true": MixedPrecision(),
    "bf16-mixed": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_params="auto"),
    "16-mixed": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, cast_params="auto"),
    "bf16-true": MixedPrecision(),  # the module itself is bf16: masters, gathers and reduction
}
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ShardPrecision(Precision):
    def __init__(self, precision: str = "32-true", device: str = "cpu") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"lightning_shard does not support `precision={precision!r}`;"
                f" supported: {', '.join(map(repr, SUPPORTED_PRECISION))}."
            )
        self.precision = precision
        self.device = device
        self.policy = _POLICY[precision]
        self.scaler: Optional[ShardedGradScaler] = ShardedGradScaler(device) if precision == "16-mixed" else None
        self.runtime = None  # set by the strategy once the model is sharded

    @classmethod
    def from_lightning(cls, plugin: Optional[Precision]) -> "ShardPrecision":
        if plugin is None or isinstance(plugin, ShardPrecision):
            return plugin or cls()
        device = str(getattr(plugin, "device", "cpu"))
        converted = cls(str(getattr(plugin, "precision", "32-true")), device=device.split(":")[0])
        given = getattr(plugin, "scaler", None)
        if converted.scaler is not None and isinstance(given, torch.amp.GradScaler):
            # Lightning's own (or the user's) torch.amp.GradScaler checks each rank's gradient shard alone: its
            # settings go to a ShardedGradScaler, whose verdict agrees across ranks
            converted.scaler = sharded_like(given, converted.device)
        return converted

    # -- module and inputs --------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    def tensor_init_context(self):  # type: ignore[override]
        return _DtypeContextManager(torch.bfloat16) if self.precision == "bf16-true" else nullcontext()

    def module_init_context(self):  # type: ignore[override]
        return self.tensor_init_context()

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype the forward runs under ``torch.autocast`` with, or None."""
        return _AUTOCAST.get(self.precision)

    def forward_context(self):  # type: ignore[override]
        dtype = self.autocast_dtype
        if dtype is not None:
            return torch.autocast(self.device, dtype=dtype)
        return self.tensor_init_context()

    # -- backward and step (16-mixed: scaled loss, a step skipped on every rank at once) ------------
    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def backward(self, tensor: Tensor, model: "pl.LightningModule", optimizer: Optional[Optimizable], *args: Any,
                 **kwargs: Any) -> None:
        try:
            super().backward(tensor, model, optimizer, *args, **kwargs)
        except RuntimeError as err:
            explain_freed_parameters(err)
            raise

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        self._agree_on_groups(optimizer)  # unscaling reads the optimizer's parameters: the same on every rank
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if not model.automatic_optimization or closure_result is not None:
            output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return output
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        # A local clip_grad_norm_ would see only this rank's shard: the norm must combine all of them.
        assert self.runtime is not None, "norm clipping before the model is sharded"
        self._agree_on_groups(optimizer)
        self.runtime.clip_grad_norm_(list(self.main_params(optimizer)), float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self._agree_on_groups(optimizer)
        super().clip_grad_by_value(optimizer, clip_val)

    def _agree_on_groups(self, optimizer: Optimizer) -> None:
        """Clipping and unscaling go over the optimizer's parameters, which a group added this step may have made
        differ between ranks (``engine/optim/optimizer_groups.py``): they agree first (every rank calls these)."""
        if self.runtime is not None:
            self.runtime.optimizers.agree_on_groups(getattr(optimizer, "_optimizer", optimizer))

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def shard_precision_of(plugin: Optional[Precision]) -> Optional[ShardPrecision]:
    """The strategy's plugin for the one Lightning gives it. Lightning's plain precision plugins (the ones its
    ``precision=`` strings make) become a ShardPrecision of the same precision. Any other plugin (a subclass with
    hooks of its own, ``BitsandbytesPrecision``, another strategy's) would lose what it does in that conversion,
    silently (a bitsandbytes run trained in fp32): refused, naming it."""
    from lightning.pytorch.plugins.precision import DoublePrecision, FSDPPrecision, HalfPrecision
    from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixed

    plain = (Precision, LightningMixed, HalfPrecision, DoublePrecision, FSDPPrecision)
    if plugin is None or isinstance(plugin, ShardPrecision) or type(plugin) in plain:
        return ShardPrecision.from_lightning(plugin) if plugin is not None else None
    raise TypeError(
        f"lightning_shard: ShardStrategy runs its own precision plugin (ShardPrecision: the dtypes of gathers and"
        f" reductions, a gradient scaler whose verdict all ranks share, clipping over every shard), so"
        f" {type(plugin).__name__}'s own behaviour would be lost. Choose the precision with Trainer(precision=...)"
        f" ({', '.join(map(repr, SUPPORTED_PRECISION))}) or ShardStrategy(mixed_precision=...), or subclass"
        " lightning_shard.lightning.precision.ShardPrecision and pass it as the Trainer's plugin.")
