"""``load_pretrained``: a weights file or a Hugging Face folder into a module, sharded or not (each rank reads only
its slices, see ``weights.py``), names matched the way Hugging Face and peft name them (``hf.py``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint import conversion, hf
from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.from_pretrained import built, loaded_dtypes
from lightning_shard.checkpoint.peft_meta import magnitudes_from_base
from lightning_shard.checkpoint.sources import ADAPTER_CONFIG, RenamedSource, RoundedSource, open_weights
from lightning_shard.checkpoint.weights import load_into
from lightning_shard.engine.shard_module import sharded_root_of


def load_pretrained(module: nn.Module, path: Optional[Union[str, Path]] = None, strict: bool = True,
                    prefix: Optional[str] = None, adapter: Optional[str] = None) -> tuple[list[str], list[str]]:
    """Load weights into ``module``, sharded (by ``ShardStrategy`` or ``shard_module``) or not.

    ``path``: a ``.safetensors`` file, a torch file of a state dict, a Hugging Face model folder (what
    ``save_pretrained`` writes: ``model.safetensors``, or ``model.safetensors.index.json`` and its shards) or a
    peft adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``). None: the folder of each model
    in ``module`` built by ``lightning_shard.from_pretrained`` (which ``ShardStrategy`` loads at setup itself).

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
    if path is None:
        return _load_built(module, strict)
    path = Path(path)
    if next(module.parameters(), None) is None:
        raise CheckpointError(f"load_pretrained: {type(module).__name__} has no parameters yet (is it built in"
                              " `configure_model`?): load into it once it is built and sharded, in `on_fit_start`.")
    adapter_folder = path.is_dir() and (path / ADAPTER_CONFIG).is_file()
    with open_weights(path) as source:
        in_model = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        in_model |= {n for n, _ in _persistent_buffers(module)}
        # the module itself, each transformers or peft model in it, and each one's base model (a folder saved from
        # `BertModel` into a `BertForSequenceClassification`, as from_pretrained takes it: the head stays as it is)
        candidates = [prefix] if prefix is not None else list(dict.fromkeys(
            ["", *(p for p, _ in hf.find_all_pretrained(module)), *_base_models(module)]))
        if adapter_folder:  # only a peft model takes an adapter
            candidates = [p for p in candidates if hf.is_peft_model(_at(module, p))]
            if not candidates:
                raise CheckpointError(f"load_pretrained: {str(path)!r} is a peft adapter folder; it goes into a peft"
                                      " model (`peft.get_peft_model`), and the module holds none"
                                      f"{'' if prefix is None else f' at prefix {prefix!r}'}.")
        # each candidate's view of the files: under its names as transformers converts them (fused experts)
        views = {p: source if adapter_folder else _as_loaded(conversion.as_model_names(source, _at(module, p)),
                                                               _at(module, p)) for p in candidates}
        mappings = [(p, *_model_names(module, p, sorted(views[p].names()), in_model, adapter_folder, adapter))
                    for p in candidates]
        matched = [len(in_model.intersection(m[1])) for m in mappings]
        best = [m[0] for m, n in zip(mappings, matched) if n == max(matched)]
        if len(best) > 1 and max(matched):
            raise CheckpointError(f"load_pretrained: {str(path)!r} fits the models at {[p.rstrip('.') for p in best]}"
                                  " alike: pass `prefix=` to choose one.")
        prefix, renamed, not_expected = mappings[matched.index(max(matched))]
        if adapter_folder:
            _check_adapter_config(_at(module, prefix), path, adapter)
        source = RenamedSource(views[prefix], renamed)
        _check_ties(module, source)
        runtime, at = sharded_root_of(module)  # a sharded model, or a module in one (a LightningModule's self.model)
        if runtime is not None:
            missing, unexpected = load_into(runtime, source, strict=strict, prefix=at,
                                            not_expected=lambda name: not_expected(name[len(at):]))
            missing = [name[len(at):] for name in missing]  # (load_into's are the root's names, under `at`)
        else:
            missing, unexpected = _load_unsharded(module, source, strict, not_expected)
        if not any("lora_magnitude_vector" in name for name in source.names()):  # a base: DoRA's magnitudes from it
            magnitudes_from_base(_at(module, prefix), runtime)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    fresh = _outside_base(module, prefix) if prefix in _base_models(module) else []
    if fresh and rank0:
        warnings.warn(f"load_pretrained: {str(path)!r} holds the base model at {prefix.rstrip('.')!r} alone;"
                      f" {fresh[:8]} keep their initial values, as from_pretrained leaves them: train them.")
    if (missing or unexpected) and rank0:
        warnings.warn(f"load_pretrained({str(path)!r}, strict=False) skipped: {len(missing)} weights of the module"
                      f" not in the files {missing[:8]}, {len(unexpected)} in the files not in the module"
                      f" {unexpected[:8]}.")
    return missing, unexpected


def _load_built(module: nn.Module, strict: bool) -> tuple[list[str], list[str]]:
    """Each model built by ``from_pretrained`` in ``module``, from its folder."""
    models = built(module)
    if not models:
        raise CheckpointError(f"load_pretrained: no path given, and {type(module).__name__} holds no model built by"
                              " lightning_shard.from_pretrained: give the weights' path.")
    missing: list[str] = []
    unexpected: list[str] = []
    for prefix, _, record in models:
        found = load_pretrained(module, record.path, strict=strict, prefix=prefix)
        missing += found[0]
        unexpected += found[1]
    return missing, unexpected


def _as_loaded(source: object, model: nn.Module) -> object:
    """A model built by ``from_pretrained`` takes each weight as transformers' ``from_pretrained`` loads it:
    rounded to the dtype it was built in first (bf16), then to the model's (float32 after peft's
    ``prepare_model_for_kbit_training``)."""
    dtypes = loaded_dtypes(model)
    return RoundedSource(source, dtypes) if dtypes else source


def _model_names(module: nn.Module, prefix: str, names: list[str], in_model: set[str], adapter_folder: bool,
                 adapter: Optional[str]) -> tuple[dict[str, str], Callable[[str], bool]]:
    """The module's name for each of the files' names (``in_model``: the module's), and which of the module's
    weights the files are not meant to hold."""
    target = _at(module, prefix)
    if not hf.is_peft_model(target):
        return {prefix + name: name for name in names}, lambda name: not name.startswith(prefix)
    adapters = hf.adapter_names(target)
    if adapter_folder:
        adapter = adapter or target.active_adapter
        if adapter not in adapters:
            raise CheckpointError(f"load_pretrained: the peft model has no adapter {adapter!r} (it has {adapters}).")
        to_file = lambda rel: hf.adapter_file_name(rel, adapter) if hf.is_adapter_weight(rel, [adapter]) else None
    else:  # the base's weights, and the adapters' copies of the modules peft saves whole (peft copies the original)
        to_file = lambda rel: hf.copied_name(rel, adapters) if hf.is_adapter_weight(rel, adapters) else hf.base_name(rel)
    by_file: dict[str, list[str]] = {}
    for name in sorted(in_model):
        if name.startswith(prefix) and (file_name := to_file(name[len(prefix):])) is not None:
            by_file.setdefault(file_name, []).append(name)
    renamed = {ours: name for name in names for ours in by_file.get(name, [prefix + name])}
    mapped = {ours for ours_all in by_file.values() for ours in ours_all}
    return renamed, lambda name: name not in mapped


def _base_models(module: nn.Module) -> list[str]:
    """The prefixes of the base models inside the transformers models of ``module`` (``"model.bert."``)."""
    found = []
    for p, model in hf.find_all_pretrained(module):
        base = getattr(model, "base_model_prefix", "")
        if hf.is_transformers_model(model) and base and isinstance(getattr(model, base, None), nn.Module):
            found.append(f"{p}{base}.")
    return found


def _outside_base(module: nn.Module, base: str) -> list[str]:
    """The weights of the transformers model holding the base model at ``base`` that are not the base's (its
    head; a head tied to the base's embedding is the base's)."""
    owner = base[: base.rstrip(".").rfind(".") + 1]
    return sorted(names[0] for names in hf.names_per_parameter(module)
                  if names[0].startswith(owner) and not any(n.startswith(base) for n in names))


def _at(module: nn.Module, prefix: str) -> nn.Module:
    return module.get_submodule(prefix[:-1]) if prefix else module


def _persistent_buffers(module: nn.Module) -> list[tuple[str, object]]:
    return [(f"{m}.{b}" if m else b, buf) for m, sub in module.named_modules()
            for b, buf in sub._buffers.items() if buf is not None and b not in sub._non_persistent_buffers_set]


def _load_unsharded(module: nn.Module, source: RenamedSource, strict: bool,
                    not_expected: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    if any(p.is_meta for p in module.parameters()):
        raise CheckpointError("load_pretrained: the module is still on the meta device; load after the strategy"
                              " has sharded it (e.g. in `on_fit_start`).")
    result = module.load_state_dict({n: source.whole(n) for n in source.names()}, strict=False)
    found = set(source.names())
    tied = [names for names in _tie_groups(module) if found.intersection(names)]
    covered = {n for names in tied for n in names}  # a tie is loaded through any one of its names
    missing = [n for n in result.missing_keys if not not_expected(n) and n not in covered]
    if strict and (missing or result.unexpected_keys):
        raise CheckpointError(f"The weights do not fit the model: missing {missing[:8]}, unexpected"
                              f" {list(result.unexpected_keys)[:8]}.")
    return missing, list(result.unexpected_keys)


# the adapter settings that change what an adapter's weights compute: they must be the model's too
_ADAPTER_SETTINGS = ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
                     "use_dora", "bias", "target_modules", "modules_to_save", "lora_bias")


def _check_adapter_config(model: nn.Module, path: Path, adapter: Optional[str]) -> None:
    """An adapter folder's weights mean what its ``adapter_config.json`` says: refused into a peft model configured
    otherwise (another ``lora_alpha`` scales the same weights differently), naming the settings."""
    saved = json.loads((path / ADAPTER_CONFIG).read_text())
    ours = model.peft_config[adapter or model.active_adapter].to_dict()
    differ = [f"{k}: folder {saved.get(k)!r}, model {ours.get(k)!r}" for k in _ADAPTER_SETTINGS
              if k in saved and k in ours and _setting(saved[k]) != _setting(ours[k])]
    if differ and ours.get("target_parameters") and not saved.get("target_parameters"):
        raise CheckpointError(f"load_pretrained: the adapter in {str(path)!r} was trained on modules the model no longer"
                              f" has ({saved.get('target_modules')!r}: transformers 4's per-expert layers, fused in"
                              " transformers 5), and peft converts such an adapter as it loads it: load it with"
                              " PeftModel.from_pretrained in one process, or train the adapter again.")
    if differ:
        raise CheckpointError(f"load_pretrained: the adapter in {str(path)!r} was trained with other settings than the"
                              f" model's: {'; '.join(differ)}. Build the peft model with the folder's adapter_config.json"
                              " (PeftConfig.from_pretrained) or load the folder with PeftModel.from_pretrained.")


def _setting(value: object) -> str:
    """A config value as comparable text: lists and sets unordered, enums by value (json has both as strings)."""
    if isinstance(value, (set, list, tuple)):
        return json.dumps(sorted(str(getattr(v, "value", v)) for v in value))
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, default=str)
    return json.dumps(getattr(value, "value", value), default=str)


def _tie_groups(module: nn.Module) -> list[list[str]]:
    return [names for names in hf.names_per_parameter(module) if len(names) > 1]


def _check_ties(module: nn.Module, source: RenamedSource, chunk: int = 1 << 24) -> None:
    """A weight the module ties (an LM head to the input embedding) found under two names in the files with two
    different values (a model saved untied): one would silently win. Refused, naming them."""
    present = set(source.names())
    for names in _tie_groups(module):
        given = [n for n in names if n in present]
        for other in given[1:]:
            size = source.shape(given[0]).numel()
            if source.shape(other) != source.shape(given[0]) or any(
                    not torch.equal(source.read(given[0], lo, min(lo + chunk, size)),
                                    source.read(other, lo, min(lo + chunk, size))) for lo in range(0, size, chunk)):
                raise CheckpointError(f"load_pretrained: the module ties {given[0]!r} and {other!r}, and the files"
                                      " hold different values for them (a model saved untied, e.g."
                                      " tie_word_embeddings=False): build the model untied, or load one of them.")
