"""Hugging Face conventions, for loading and exporting: where a transformers or peft model sits inside a module
(a LightningModule's ``self.model``), how a peft model's parameter names relate to its base model's names and to
its adapter files', and the configs a folder carries. transformers and peft stay optional: nothing here imports
them unless a model or folder needs them.

A peft model names its parameters ``base_model.model.<base name>``, a wrapped layer's own weight under
``base_layer`` (``q_proj.base_layer.weight``), an adapter's with the adapter's name (``q_proj.lora_A.default.weight``);
its adapter files drop the adapter's name (``q_proj.lora_A.weight``), and its base model's folder has the base
names (``q_proj.weight``).
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from typing import Any, Optional

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."
_WRAPPER_SEGMENTS = {"base_layer", "original_module"}  # peft's infixes between a wrapped module and its weights


def require(package: str, what: str) -> Any:
    """Import ``package`` or say what needs it and how to install it."""
    try:
        return __import__(package)
    except ImportError as err:
        raise ImportError(f"lightning_shard: {what} needs `{package}`: pip install {package}") from err


def is_peft_model(module: nn.Module) -> bool:
    return isinstance(getattr(module, "peft_config", None), dict) and hasattr(module, "base_model")


def is_transformers_model(module: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # loaded if the module is one: no import just to ask
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def saved_config(model: nn.Module, dtype: Optional[torch.dtype]) -> Any:
    """A copy of a transformers model's config as its ``save_pretrained`` writes it: with ``architectures`` (the
    class, which serving tools read) and the files' floating ``dtype``; the model's own config is left as it is."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    if dtype is not None:  # (transformers 4 calls it torch_dtype)
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", str(dtype).removeprefix("torch."))
    return config


def with_dtype(config_json: str, dtype: torch.dtype) -> str:
    """``config_json`` saying the files hold ``dtype`` (transformers 4 calls the key ``torch_dtype``, 5 ``dtype``)."""
    config = json.loads(config_json)
    key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    config[key] = str(dtype).removeprefix("torch.")
    return json.dumps(config, indent=2, sort_keys=True) + "\n"  # as transformers writes it


def floating_dtype(model: nn.Module) -> Optional[torch.dtype]:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def find_all_pretrained(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost peft and transformers models in ``module`` (itself included), each with its name prefix
    (``"model."`` for a LightningModule's ``self.model``)."""
    found: list[tuple[str, nn.Module]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        if is_peft_model(m) or is_transformers_model(m):
            found.append((prefix, m))
            return
        for name, child in m.named_children():
            visit(child, f"{prefix}{name}.")

    visit(module, "")
    return found


def find_pretrained(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The one peft or transformers model in ``module`` and its prefix; None if there is none. Several side by side
    (a teacher and a student) are an error: say which with ``prefix=``."""
    found = find_all_pretrained(module)
    if len(found) > 1:
        raise ValueError(f"lightning_shard: {len(found)} Hugging Face models in the module, at"
                         f" {[p.rstrip('.') for p, _ in found]}: pass `prefix=` to choose one.")
    return found[0] if found else None


def adapter_names(model: nn.Module) -> list[str]:
    return list(model.peft_config) if is_peft_model(model) else []


def is_adapter_weight(name: str, adapters: list[str]) -> bool:
    """A peft model's name of an adapter's weight (the adapter's name is one of its segments)."""
    return any(a in name.split(".") for a in adapters)


def base_name(peft_name: str) -> str:
    """``base_model.model.x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``: the base model's name."""
    name = peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def adapter_file_name(peft_name: str, adapter: str) -> str:
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``, ``...score.modules_to_save.default.weight``
    -> ``...score.weight``: the name in the adapter's files."""
    parts = peft_name.split(".")
    kept = [p for i, p in enumerate(parts)
            if p != adapter and not (p == "modules_to_save" and i + 1 < len(parts) and parts[i + 1] == adapter)]
    return ".".join(kept)


def copied_name(peft_name: str, adapters: list[str]) -> Optional[str]:
    """An adapter's copy of a module peft saves whole (``modules_to_save``): the base model's name of the weight it
    copies (``...score.modules_to_save.default.weight`` -> ``...score.weight``); None for any other name."""
    parts = peft_name.split(".")
    if "modules_to_save" not in parts:
        return None
    i = parts.index("modules_to_save")
    return base_name(".".join(parts[:i] + parts[i + 2:])) if parts[i + 1: i + 2] and parts[i + 1] in adapters else None


def merged_name(peft_name: str, adapter: str) -> Optional[str]:
    """A peft model's weight in the base model it merges into: the base weight's name, the trained copy of a module
    peft saves whole (``modules_to_save``) in place of the original; None for what merging consumes (the adapter's
    own weights) or drops (the original of a module saved whole, another adapter's copy)."""
    parts = peft_name.split(".")
    if "modules_to_save" in parts:
        return copied_name(peft_name, [adapter])
    if "original_module" in parts:
        return None
    return None if adapter in parts else base_name(peft_name)


def architecture_class(config: Any) -> Optional[type]:
    """The transformers class a config's ``architectures`` names (what ``save_pretrained`` records); None if none."""
    architecture = (getattr(config, "architectures", None) or [None])[0]
    transformers = sys.modules.get("transformers")  # loaded: the config is one of its objects
    return getattr(transformers, architecture, None) if transformers and isinstance(architecture, str) else None


def model_on_meta(cls: Any, config: Any) -> nn.Module:
    """``cls(config)`` built on the meta device (nothing allocated), transformers' init warnings muted."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(config)


def names_per_parameter(module: nn.Module) -> list[list[str]]:
    """Every name of each parameter of ``module`` (a tied weight has several), in registration order."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return list(by_id.values())


def tied_targets(model: nn.Module) -> set[str]:
    """Names a transformers model leaves out of its files when they are tied to another (``lm_head.weight`` to
    the input embedding)."""
    tied = getattr(model, "_tied_weights_keys", None)  # a dict target -> source (>= 5), a list of targets before
    return set(tied) if isinstance(tied, (dict, list, tuple)) else set()
