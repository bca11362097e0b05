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

import sys
from typing import Any, Optional

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


def find_pretrained(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The outermost peft or transformers model in ``module`` (itself included) and its name prefix
    (``"model."`` for a LightningModule's ``self.model``); None if there is none. Several side by side are an
    error: say which with ``prefix=``."""
    found: list[tuple[str, nn.Module]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        if is_peft_model(m) or is_transformers_model(m):
            found.append((prefix, m))
            return
        for name, child in m.named_children():
            visit(child, f"{prefix}{name}.")

    visit(module, "")
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
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``: the name in the adapter's files."""
    return ".".join(part for part in peft_name.split(".") if part != adapter)


def tied_targets(model: nn.Module) -> set[str]:
    """Names a transformers model leaves out of its files when they are tied to another (``lm_head.weight`` to
    the input embedding)."""
    tied = getattr(model, "_tied_weights_keys", None)  # a dict target -> source (>= 5), a list of targets before
    return set(tied) if isinstance(tied, (dict, list, tuple)) else set()
