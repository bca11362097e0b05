"""``load_pretrained``: a weights file or a Hugging Face folder into a module, sharded or not (each rank reads only
its slices, see ``weights.py``), names matched the way Hugging Face and peft name them (``hf.py``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Optional, Union

import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint import hf
from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.sources import ADAPTER_CONFIG, RenamedSource, open_weights
from lightning_shard.checkpoint.weights import load_into


def load_pretrained(module: nn.Module, path: Union[str, Path], strict: bool = True, prefix: Optional[str] = None,
                    adapter: Optional[str] = None) -> tuple[list[str], list[str]]:
    """Load weights into ``module``, sharded (by ``ShardStrategy`` or ``shard_module``) or not.

    ``path``: a ``.safetensors`` file, a torch file of a state dict, a Hugging Face model folder (what
    ``save_pretrained`` writes: ``model.safetensors``, or ``model.safetensors.index.json`` and its shards) or a
    peft adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``).

    Names: ``prefix`` + the file's. By default the prefix is where the Hugging Face or peft model sits in
    ``module`` (``"model."`` for a LightningModule's ``self.model``), or none, whichever matches more of the
    files' names (a Lightning checkpoint's state dict has the module's own names). Into a peft model, a base model's
    folder fills the base weights (``q_proj.weight`` into ``q_proj.base_layer.weight``) and an adapter folder the
    adapter's (``adapter``, by default the active one).

    ``strict``: a weight the module lacks, a weight of the module the files lack (but a peft model's adapter from a
    base folder, and its base from an adapter folder), or a shape mismatch is an error naming it; ``strict=False``
    loads what matches and warns with what it skipped. Returns ``(missing, unexpected)`` as ``load_state_dict``.
    With Lightning, call it in ``on_fit_start`` (the model is sharded then, and ``fit(ckpt_path=...)`` restores
    after it).
    """
    path = Path(path)
    adapter_folder = path.is_dir() and (path / ADAPTER_CONFIG).is_file()
    with open_weights(path) as source:
        names = sorted(source.names())
        in_model = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        in_model |= {n for n, _ in _persistent_buffers(module)}
        found = hf.find_pretrained(module) if prefix is None else None
        candidates = [prefix] if prefix is not None else ["", found[0]] if found is not None and found[0] else [""]
        if adapter_folder:  # only a peft model takes an adapter
            candidates = [p for p in candidates if hf.is_peft_model(module.get_submodule(p[:-1]) if p else module)]
            if not candidates:
                raise CheckpointError(f"load_pretrained: {str(path)!r} is a peft adapter folder; it goes into a peft"
                                      " model (`peft.get_peft_model`), and the module holds none"
                                      f"{'' if prefix is None else f' at prefix {prefix!r}'}.")
        mappings = [_model_names(module, p, names, in_model, adapter_folder, adapter) for p in candidates]
        renamed, not_expected = max(mappings, key=lambda m: len(in_model.intersection(m[0])))
        source = RenamedSource(source, renamed)
        runtime = getattr(module, "_shard_runtime", None)
        if runtime is not None:
            missing, unexpected = load_into(runtime, source, strict=strict, not_expected=not_expected)
        else:
            missing, unexpected = _load_unsharded(module, source, strict, not_expected)
    if (missing or unexpected) and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"load_pretrained({str(path)!r}, strict=False) skipped: {len(missing)} weights of the module"
                      f" not in the files {missing[:8]}, {len(unexpected)} in the files not in the module"
                      f" {unexpected[:8]}.")
    return missing, unexpected


def _model_names(module: nn.Module, prefix: str, names: list[str], in_model: set[str], adapter_folder: bool,
                 adapter: Optional[str]) -> tuple[dict[str, str], Callable[[str], bool]]:
    """The module's name for each of the files' names (``in_model``: the module's), and which of the module's
    weights the files are not meant to hold."""
    target = module.get_submodule(prefix[:-1]) if prefix else module
    if not hf.is_peft_model(target):
        return {prefix + name: name for name in names}, lambda name: not name.startswith(prefix)
    adapters = hf.adapter_names(target)
    if adapter_folder:
        adapter = adapter or target.active_adapter
        if adapter not in adapters:
            raise CheckpointError(f"load_pretrained: the peft model has no adapter {adapter!r} (it has {adapters}).")
        to_file = lambda rel: hf.adapter_file_name(rel, adapter) if hf.is_adapter_weight(rel, [adapter]) else None
    else:
        to_file = lambda rel: None if hf.is_adapter_weight(rel, adapters) else hf.base_name(rel)
    by_file = {}
    for name in sorted(in_model):
        if name.startswith(prefix) and (file_name := to_file(name[len(prefix):])) is not None:
            by_file.setdefault(file_name, name)
    renamed = {by_file.get(name, prefix + name): name for name in names}
    mapped = set(by_file.values())
    return renamed, lambda name: name not in mapped


def _persistent_buffers(module: nn.Module) -> list[tuple[str, object]]:
    return [(f"{m}.{b}" if m else b, buf) for m, sub in module.named_modules()
            for b, buf in sub._buffers.items() if buf is not None and b not in sub._non_persistent_buffers_set]


def _load_unsharded(module: nn.Module, source: RenamedSource, strict: bool,
                    not_expected: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    if any(p.is_meta for p in module.parameters()):
        raise CheckpointError("load_pretrained: the module is still on the meta device; load after the strategy"
                              " has sharded it (e.g. in `on_fit_start`).")
    result = module.load_state_dict({n: source.whole(n) for n in source.names()}, strict=False)
    missing = [n for n in result.missing_keys if not not_expected(n)]
    if strict and (missing or result.unexpected_keys):
        raise CheckpointError(f"The weights do not fit the model: missing {missing[:8]}, unexpected"
                              f" {list(result.unexpected_keys)[:8]}.")
    return missing, list(result.unexpected_keys)
