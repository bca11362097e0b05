"""``lightning_shard.from_pretrained``: a Hugging Face model built as transformers' ``from_pretrained`` builds it, in
bf16 or 4 bits, but on the meta device, its weights loaded once it is sharded, each rank reading only its slices.

transformers' ``from_pretrained`` builds the model on the meta device, swaps in the quantized layers (bitsandbytes'
``Linear4bit``, the head and what ``modules_to_not_convert`` names left in full precision), then loads: each weight
is read from the files, cast to the dtype it was built in (``dtype``, or float32 where the model keeps a module in
float32) and quantized where its layer is 4-bit; the buffers that are not in the files (Llama's rotary ``inv_freq``)
are computed by the model's init, in the dtype the model gives them (float32). Built by hand, a recipe misses one of
these (a ``.to(torch.bfloat16)`` casts ``inv_freq`` too) and trains another model than the one peft later loads the
adapter onto.

Here the same steps run with transformers' own pieces, in the same order, up to the loading; the loading is
``load_pretrained``'s, after sharding. Whatever is done to the built model before (peft's
``prepare_model_for_kbit_training``, which casts the bf16 weights to float32), each weight is rounded to the dtype
``from_pretrained`` would have loaded it in first, then cast to the model's: the numbers of ``from_pretrained``
followed by the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_shard.checkpoint import hf
from lightning_shard.checkpoint.sources import weight_files

RECORD = "_lightning_shard_pretrained"  # the attribute of a built model holding its `Pretrained`


@dataclass
class Pretrained:
    """Where a model built by :func:`from_pretrained` comes from, and in which dtype ``from_pretrained`` would have
    loaded each of its weights (by the model's own names)."""

    path: Path
    loaded_dtypes: dict[str, torch.dtype] = field(default_factory=dict)


def from_pretrained(path: Union[str, Path], *, model_class: Any = None, dtype: Union[str, torch.dtype] = "auto",
                    quantization_config: Any = None, attn_implementation: Optional[str] = None) -> nn.Module:
    """A transformers model from the local folder ``path``, as ``model_class.from_pretrained(path, dtype=...,
    quantization_config=..., attn_implementation=...)`` makes it (``model_class``: an ``AutoModelFor...`` class or a
    model class, by default ``AutoModelForCausalLM``).

    Called where the default device is the meta device (a LightningModule's ``configure_model`` under
    ``ShardStrategy``, or ``with torch.device("meta")``), it allocates nothing: the model is built on the meta device
    and remembers ``path``; ``ShardStrategy`` loads it once the model is sharded (``load_pretrained(module)`` does it
    for a model sharded by ``shard_module``), each rank reading and quantizing only the slices of its shards. The
    weights, their quantization state, the buffers and the dtypes are then those of ``from_pretrained``, bit for
    bit, and stay so through what is done to the built model before it is sharded (peft's
    ``prepare_model_for_kbit_training``, ``get_peft_model``). Anywhere else it is transformers' ``from_pretrained``.
    """
    transformers = hf.require("transformers", "lightning_shard.from_pretrained")
    model_class = model_class or transformers.AutoModelForCausalLM
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"lightning_shard.from_pretrained: {str(path)!r} is not a Hugging Face model folder"
                                " (no config.json); it reads local folders only: download the model first.")
    if not _dtype_ok(dtype):
        raise ValueError(f"lightning_shard.from_pretrained: dtype={dtype!r}; allowed: 'auto', a floating torch.dtype"
                         " (torch.bfloat16, torch.float16, torch.float32) or its name.")
    options = {"dtype": dtype, "quantization_config": quantization_config}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    if torch.get_default_device().type != "meta":
        return model_class.from_pretrained(path, **options)
    model = _build_on_meta(transformers, model_class, path, dtype, quantization_config, attn_implementation)
    setattr(model, RECORD, Pretrained(path, {name: t.dtype for name, t in _loaded_tensors(model)}))
    return model


def _dtype_ok(dtype: Any) -> bool:
    if isinstance(dtype, str):
        dtype = dtype if dtype == "auto" else getattr(torch, dtype, None)
    return dtype == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)


def _build_on_meta(transformers: Any, model_class: Any, path: Path, dtype: Any, quantization_config: Any,
                   attn_implementation: Optional[str]) -> nn.Module:
    """transformers' ``from_pretrained`` up to the loading (transformers 5: ``PreTrainedModel.from_pretrained``):
    the config, the quantizer, the dtype, the model built in its init context, the quantized layers swapped in, the
    dtypes of the modules kept in float32; then what it does after loading and that needs no weights (ties, eval
    mode, the quantizer's attributes, the generation config)."""
    try:
        from transformers.modeling_utils import _get_dtype
        from transformers.quantizers.auto import get_hf_quantizer
        from transformers.utils.generic import ContextManagers
    except ImportError as err:
        raise ImportError(f"lightning_shard.from_pretrained needs transformers 5 (found {transformers.__version__}):"
                          " pip install 'transformers>=5'") from err
    config = transformers.AutoConfig.from_pretrained(path)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    cls = _concrete_class(model_class, config)
    quantizer, config, device_map = get_hf_quantizer(config, quantization_config, None, True, {})
    files = [str(f) for f in weight_files(path)]
    config, dtype = _get_dtype(dtype, files, config, None, None, True, quantizer)
    config.name_or_path = str(path)
    with ContextManagers(cls.get_init_context(dtype, quantizer is not None, False, False)):
        model = cls(config)
        _patch_output_recorders(model)
        if quantizer is not None:
            quantizer.preprocess_model(model=model, dtype=dtype, device_map=device_map, checkpoint_files=files,
                                       use_kernels=False)
    for param in model.parameters():  # a pre-quantized folder's 4-bit weights: the dtype they dequantize to, as
        if type(param).__name__ == "Params4bit" and not param.is_floating_point():  # a weight quantized here
            param.data = param.data.to(dtype)
    _keep_in_fp32(model, model._get_dtype_plan(dtype))
    for name, tensor in _loaded_tensors(model):  # loading makes each a new parameter, trainable if floating
        if isinstance(tensor, nn.Parameter):
            tensor.requires_grad_(tensor.is_floating_point())
    model.tie_weights()
    model.eval()  # as from_pretrained returns it
    if quantizer is not None:
        model.hf_quantizer = quantizer
        quantizer.postprocess_model(model)
    _generation_config(transformers, model, path)
    return model


def _concrete_class(model_class: Any, config: Any) -> Any:
    """The model class an ``AutoModelFor...`` class picks for ``config`` (a model class is itself)."""
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        return model_class
    from transformers.models.auto.auto_factory import _get_model_class

    if type(config) not in mapping.keys():
        raise ValueError(f"lightning_shard.from_pretrained: {model_class.__name__} has no model for a"
                         f" {type(config).__name__}; pass the model_class that fits the folder.")
    return _get_model_class(config, mapping)


def _patch_output_recorders(model: nn.Module) -> None:
    try:
        from transformers.monkey_patching import patch_output_recorders
    except ImportError:  # (not in every transformers 5 release)
        return
    patch_output_recorders(model)


def _keep_in_fp32(model: nn.Module, dtype_plan: dict[str, torch.dtype]) -> None:
    """The weights ``from_pretrained`` loads in another dtype than the model's (``_keep_in_fp32_modules_strict``):
    cast to it, as loading them gives them that dtype."""
    if not dtype_plan:
        return
    from transformers.core_model_loading import build_glob_alternation

    pattern, by_group, _ = build_glob_alternation(list(dtype_plan))
    for name, tensor in _loaded_tensors(model):
        found = pattern.search(name)
        if found is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype_plan[by_group[found.lastgroup]])


def _loaded_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters (each tie under all its names) and persistent buffers the files fill, but the 4-bit weights
    (quantized from the files' values in the model's dtype, ``quantized_load.py``)."""
    params = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if type(p).__name__ != "Params4bit"]
    buffers = [(f"{m}.{b}" if m else b, t) for m, sub in model.named_modules() for b, t in sub._buffers.items()
               if t is not None and b not in sub._non_persistent_buffers_set]
    return params + buffers


def _generation_config(transformers: Any, model: nn.Module, path: Path) -> None:
    if not model.can_generate():
        return
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: from_pretrained takes it from the model's config
        model.generation_config = transformers.GenerationConfig.from_model_config(model.config)


def built(module: nn.Module) -> list[tuple[str, nn.Module, Pretrained]]:
    """The models in ``module`` built by :func:`from_pretrained`: the prefix of the outermost transformers or peft
    model holding each, that model, and where it comes from."""
    found = []
    for prefix, model in hf.find_all_pretrained(module):
        base = model.get_base_model() if hf.is_peft_model(model) else model
        record = getattr(base, RECORD, None)
        if isinstance(record, Pretrained):
            found.append((prefix, model, record))
    return found


def loaded_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """The dtype ``from_pretrained`` loads each weight of ``model`` in (its base's, for a peft model), by the
    transformers model's names; empty for a model not built by :func:`from_pretrained`."""
    base = model.get_base_model() if hf.is_peft_model(model) else model
    record = getattr(base, RECORD, None)
    return dict(record.loaded_dtypes) if isinstance(record, Pretrained) else {}
