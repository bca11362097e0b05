"""Models whose weights transformers names and shapes one way in their files and another in memory.

transformers 5 fuses the routed experts of Mixtral, Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V3 and others: the files hold one
2-D tensor per expert and projection (``mlp.experts.3.gate_proj.weight``), the model one 3-D tensor per layer
(``mlp.experts.gate_up_proj``, the experts stacked, gate and up concatenated), and some names change (Mixtral's
``block_sparse_moe`` is ``mlp``). Its ``from_pretrained`` converts as it loads, its ``save_pretrained`` converts back.

Here both ways, with transformers' own conversion table:

* in: :func:`as_model_names` shows a folder under the model's names, a fused tensor read as the files' tensors one
  after another (so a rank still reads only the slices its shards own);
* out: :class:`FileNames` turns each tensor of an export into what the model's own ``save_pretrained`` writes (the
  per-expert names vLLM and older transformers read), through transformers' ``revert_weight_conversion``.

Transformers < 5 converts nothing; neither does this.
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_shard.checkpoint import hf
from lightning_shard.checkpoint.files import CheckpointError

# the conversions read by slices: the experts stacked (dim 0), and several projections concatenated after it (dim 1)
_STACKED = [("MergeModulelist", 0)]
_STACKED_AND_JOINED = [("MergeModulelist", 0), ("Concatenate", 1)]


def transforms(model: nn.Module) -> list[Any]:
    """transformers' renamings and converters for ``model`` (a transformers model, or a peft model's base), files
    to memory; empty for other modules and transformers < 5."""
    model = model.get_base_model() if hf.is_peft_model(model) else model
    if not hf.is_transformers_model(model):
        return []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    return list(get_model_conversion_mapping(model))


def as_model_names(source: Any, model: nn.Module) -> Any:
    """``source`` (``sources.py``) under ``model``'s names: each file name renamed as transformers renames it, the
    files' per-expert tensors as the fused tensor they make. ``source`` itself when nothing converts."""
    from_files = transforms(model)
    if not from_files:
        return source
    from transformers.core_model_loading import WeightConverter

    renamings = [t for t in from_files if not isinstance(t, WeightConverter)]
    converters = [t for t in from_files if isinstance(t, WeightConverter)]
    parts: dict[str, list[str]] = {}
    shapes: dict[str, torch.Size] = {}
    fused: dict[str, tuple[Any, dict[tuple[int, int], str]]] = {}
    for name in sorted(source.names()):
        renamed, pattern = name, None
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                break
        expert = _expert(renamed, pattern, converter) if pattern is not None else None
        if expert is None:  # no conversion, or one this cannot read by slices: the name as renamed
            _add(parts, renamed, [name])
            shapes[renamed] = source.shape(name)
        else:
            fused.setdefault(target, (converter, {}))[1][(expert, converter.source_patterns.index(pattern))] = name
    for target, (converter, pieces) in fused.items():
        _add(parts, target, _fused_parts(source, target, converter, pieces))
        shapes[target] = _fused_shape(source, parts[target], len(converter.source_patterns))
    if all(names == [name] for name, names in parts.items()):
        return source
    return ConvertedSource(source, parts, shapes)


def _expert(renamed: str, pattern: str, converter: Any) -> Optional[int]:
    """The expert's number in a file's name, where the converter's pattern has its ``*``; None for a converter
    that does not stack experts (a transpose, a split: transformers 5.24 writes those models' files as they are
    in memory, and their shapes are checked as any other's)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if ops not in (_STACKED, _STACKED_AND_JOINED) or len(converter.target_patterns) != 1 \
            or (ops == _STACKED) != (len(converter.source_patterns) == 1):
        return None
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
    return int(found.group(1)) if found is not None and found.groups() else None


def _add(parts: dict[str, list[str]], target: str, names: list[str]) -> None:
    if target in parts:
        raise CheckpointError(f"load_pretrained: the files' {parts[target][:2]} and {names[:2]} are both"
                              f" {target!r} in the model, as transformers renames them.")
    parts[target] = names


def _fused_parts(source: Any, target: str, converter: Any, pieces: dict[tuple[int, int], str]) -> list[str]:
    """The files' names whose values, flattened one after another, are ``target``'s: expert by expert, each
    expert's projections in the converter's order."""
    patterns = len(converter.source_patterns)
    experts = 1 + max(e for e, _ in pieces)
    absent = [(e, p) for e in range(experts) for p in range(patterns) if (e, p) not in pieces]
    if absent:
        raise CheckpointError(f"load_pretrained: {target!r} is made of {experts} experts' {converter.source_patterns},"
                              f" and the files lack {len(absent)} of them (expert {absent[0][0]}'s"
                              f" {converter.source_patterns[absent[0][1]]!r}).")
    names = [pieces[(e, p)] for e in range(experts) for p in range(patterns)]
    for p in range(patterns):
        shapes = {tuple(source.shape(names[e * patterns + p])) for e in range(experts)}
        if len(shapes) > 1 or len(next(iter(shapes))) < 1:
            raise CheckpointError(f"load_pretrained: the experts of {target!r} in the files have shapes {sorted(shapes)}"
                                  f" for {converter.source_patterns[p]!r}; they are stacked, so they must be alike.")
    if patterns > 1 and len({tuple(source.shape(n))[1:] for n in names[:patterns]}) > 1:
        raise CheckpointError(f"load_pretrained: the projections joined into {target!r} differ past their first"
                              f" dimension: {[tuple(source.shape(n)) for n in names[:patterns]]}.")
    return names


def _fused_shape(source: Any, names: list[str], patterns: int) -> torch.Size:
    first = [source.shape(n) for n in names[:patterns]]
    return torch.Size([len(names) // patterns, sum(s[0] for s in first), *first[0][1:]])


class ConvertedSource:
    """``source`` under other names: each of ``parts`` a list of the source's names whose values, flattened one
    after another, make it (one name: a renaming), of shape ``shapes[name]``."""

    metadata = None  # recorded under the files' names

    def __init__(self, source: Any, parts: dict[str, list[str]], shapes: dict[str, torch.Size]) -> None:
        self.source, self.parts, self.shapes = source, parts, shapes

    def names(self) -> set[str]:
        return set(self.parts)

    def shape(self, name: str) -> torch.Size:
        return self.shapes[name]

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        parts = self.parts[name]
        if len(parts) == 1:
            return self.source.read(parts[0], lo, hi)
        pieces, start = [], 0
        for part in parts:
            end = start + self.source.shape(part).numel()
            if lo < end and start < hi:
                pieces.append(self.source.read(part, max(lo, start) - start, min(hi, end) - start))
            start = end
        return torch.cat(pieces) if pieces else self.source.read(parts[0], 0, 0)

    def whole(self, name: str) -> Tensor:
        parts = self.parts[name]
        if len(parts) == 1:
            return self.source.whole(parts[0])
        return self.read(name, 0, self.shapes[name].numel()).reshape(self.shapes[name])

    def value(self, name: str) -> Any:
        """What the model's load hooks get: a fused tensor as a meta tensor of its shape (read later)."""
        parts = self.parts[name]
        if len(parts) == 1:
            return self.source.value(parts[0])
        return torch.empty(self.shapes[name], dtype=self.source.value(parts[0]).dtype, device="meta")


def meta_model(config_json: Optional[str]) -> Optional[nn.Module]:
    """The transformers model a ``config.json``'s text describes (its class named in ``architectures``), built on
    the meta device; None when there is no such text or class."""
    architecture = (json.loads(config_json).get("architectures") or [None])[0] if config_json else None
    try:
        import transformers
    except ImportError:
        return None
    if not isinstance(architecture, str) or not hasattr(transformers, architecture):
        return None  # (custom modelling code: its config may not even parse here)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(config_json)
        config = transformers.AutoConfig.from_pretrained(folder)
    cls = hf.architecture_class(config)
    return hf.model_on_meta(cls, config) if cls is not None else None


class FileNames:
    """An export's tensors under the names (and shapes) ``model``'s own ``save_pretrained`` writes: a fused experts
    tensor as one tensor per expert and projection, each in a storage of its own (safetensors' rule).

    Only conversions that make one tensor in memory are undone, a tensor at a time; a model with one that splits a
    file's tensor into several (none in transformers' MoE table) keeps the names it has in memory, which
    transformers' ``from_pretrained`` loads as well."""

    def __init__(self, model: Optional[nn.Module]) -> None:
        from_files = transforms(model) if model is not None else []
        self.converts = bool(from_files) and all(len(getattr(t, "target_patterns", ())) <= 1 for t in from_files)
        # a copy on the meta device: some conversions compare with the model's shapes (a transpose where they differ),
        # and a sharded model's parameters are 1-D shards between steps
        self.model = _meta_copy(model.get_base_model() if hf.is_peft_model(model) else model) if self.converts else None
        self.converts = self.model is not None

    def __call__(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
        if not self.converts:
            return [(name, tensor)]
        from transformers.core_model_loading import revert_weight_conversion

        out = revert_weight_conversion(self.model, {name: tensor})
        return [(n, t if t is tensor or _owns_storage(t) else t.clone()) for n, t in out.items()]


def _meta_copy(model: nn.Module) -> Optional[nn.Module]:
    try:
        return hf.model_on_meta(type(model), copy.deepcopy(model.config))
    except Exception as err:  # noqa: BLE001 - a model built otherwise: its names stay, as transformers 5 loads them
        warnings.warn(f"lightning_shard: {type(model).__name__} could not be built from its config ({err}); its export"
                      " keeps the names it has in memory, which transformers 5's from_pretrained loads.")
        return None


def _owns_storage(tensor: Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
