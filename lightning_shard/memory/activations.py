"""Activation memory of one training step, measured on fake tensors (nothing is allocated): what
``estimate_memory`` adds to its formula (``estimate.py``)."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_shard.engine.plan.gathers import GatherDtypes
from lightning_shard.engine.plan.plan import plan_units
from lightning_shard.engine.runtime.activation_checkpointing import checkpoint_targets, wrap_forward
from lightning_shard.memory.tracker import LiveBytes


def activation_bytes(model: nn.Module, step: Callable[[nn.Module, Any], Tensor], batch: Any,
                     param_dtype: Optional[torch.dtype] = None, plans: Optional[list] = None,
                     activation_checkpointing: Any = False, device: Union[str, torch.device] = "cpu",
                     autocast: Optional[torch.dtype] = None, gathers: Optional[GatherDtypes] = None) -> int:
    """Peak bytes above the parameters during one forward and backward, run on fake tensors of ``device`` (under
    ``torch.autocast`` with ``autocast`` as training runs it). Estimating for a GPU on a machine without CUDA, the
    CPU's kernels stand in (a torch without CUDA cannot run CUDA ops even on fake tensors), with a warning.
    ``gathers``: each parameter's gather dtype (the engine's), else ``param_dtype`` for every floating one."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        warnings.warn("lightning_shard: estimating for a GPU without CUDA here: activations measured with the CPU's"
                      " kernels and autocast rules (attention and norms may keep other temporaries on a GPU).",
                      stacklevel=3)
        device = torch.device("cpu")
    fake = FakeTensorMode()
    dtypes = gathers.by_parameter(plans if plans is not None else plan_units(model)) if gathers is not None else None
    shadow, fake_batch = fake_copy(model, batch, fake, device, param_dtype, dtypes,
                                   inputs_cast=gathers is None or gathers.cast_params == "all")
    if activation_checkpointing:
        plans = plans if plans is not None else plan_units(shadow)
        members = [[shadow.get_submodule(name) for name in plan.members] for plan in plans
                   if plan.members != [""] and plan.params]
        for _name, module in checkpoint_targets(shadow, members, activation_checkpointing):
            wrap_forward(module)
    for param in shadow.parameters():  # a gradient leaves at once: the engine reduces it, counted apart
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    cast = (torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext())
    try:
        with fake, LiveBytes() as live:
            live.track([*shadow.parameters(), *shadow.buffers(), *_tensors(fake_batch)])
            baseline = live.current()
            live.reset_peak()
            with cast:
                loss = step(shadow, fake_batch)
            loss.backward()
    except (RuntimeError, NotImplementedError) as err:  # (fake tensors' own errors derive from these)
        raise ValueError(
            f"estimate_memory: the step could not run on fake tensors ({type(err).__name__}: {str(err)[:200]}), which"
            " is how activations are measured without allocating them. Routed experts are a known case:"
            " transformers 5's `grouped_mm` experts run on fake tensors in bf16 only (`param_dtype=torch.bfloat16`)"
            " and its eager experts choose tokens by their values (`nonzero`). Estimate without activations"
            " (`step=None`) and add those of a real step measured on a small batch.") from err
    return max(live.peak - baseline, 0)


def fake_copy(model: nn.Module, batch: Any, fake: FakeTensorMode, device: torch.device,
              dtype: Optional[torch.dtype] = None, gathered: Optional[dict[int, torch.dtype]] = None,
              inputs_cast: bool = True) -> tuple[nn.Module, Any]:
    """``model`` and ``batch`` with every tensor replaced by a fake one on ``device`` (nothing is allocated), floating
    ones in ``dtype`` (a parameter in its gather dtype where ``gathered`` has it, by id; the inputs as they are unless
    ``inputs_cast``: autocast casts them, as the engine leaves them)."""
    if getattr(model, "_shard_runtime", None) is not None:
        raise ValueError("estimate_memory takes the model before sharding (it is sharded already).")

    def empty(t: Tensor, as_dtype: Optional[torch.dtype] = dtype) -> Tensor:
        cast = as_dtype if as_dtype is not None and t.is_floating_point() else t.dtype
        with fake:
            return torch.empty(t.shape, dtype=cast, device=device)

    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in memo:
            if not isinstance(tensor, nn.Parameter):
                memo[id(tensor)] = empty(tensor)
                continue
            as_dtype = gathered.get(id(tensor), dtype) if gathered is not None else dtype
            memo[id(tensor)] = nn.Parameter(empty(tensor, as_dtype), tensor.requires_grad)
    shadow = copy.deepcopy(model, memo)
    for original, module in zip(model.modules(), shadow.modules()):  # 4-bit layers: their memory on plain fakes
        if type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes"):
            state = getattr(original.weight, "quant_state", None)  # (quantized: its weight is packed)
            with fake:
                module.weight = nn.Parameter(torch.empty(state.shape if state is not None else original.weight.shape,
                                                         device=device), requires_grad=False)
            module.forward = _FourBitLinear(module)
    inputs = dtype if inputs_cast else None
    return shadow, tree_map(lambda x: empty(x, inputs) if isinstance(x, Tensor) else x, batch)


class _FourBitLinear:
    """bitsandbytes' ``Linear4bit`` as its kernels use memory (``MatMul4Bit`` on the CPU): the input in the compute
    dtype, the weight dequantized (fp32, then the compute dtype) for the product in forward and again in backward,
    and nothing saved for backward but the packed weight."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        module = self.module
        compute = module.compute_dtype or x.dtype
        bias = module.bias.to(compute) if module.bias is not None else None
        return _Dequantizing.apply(x.to(compute), module.weight, bias).to(x.dtype)


class _Dequantizing(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.weight, ctx.dtype = weight, x.dtype
        return nn.functional.linear(x, weight.float().to(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, Optional[Tensor]]:
        return grad @ ctx.weight.float().to(ctx.dtype), None, None


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]
