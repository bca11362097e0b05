"""A checkpoint on disk (a sharded directory or a full file) exported as a Hugging Face folder, in one process and
without the model: the weights are read a file's worth at a time, so the process holds at most one output file's
tensors (and a tensor larger than that alone), never the optimizer state.

What the folder needs besides the weights comes from the checkpoint's record, written by ShardStrategy when the
LightningModule holds a transformers or peft model (its place in the module, its config, its tied weights, its
adapter's config), or from ``model_config`` (a transformers ``config.json``, or a folder holding one), which also
serves checkpoints of other strategies. ``python -m lightning_shard.export`` is the command.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard.checkpoint import conversion, files, hf
from lightning_shard.checkpoint.export import carried_over
from lightning_shard.checkpoint.safetensors_writer import SafetensorsWriter, parse_size
from lightning_shard.checkpoint.sharded import MODEL_PREFIX, read_metadata

RECORD = "lightning_shard"  # the checkpoint's key for what ShardStrategy adds


def export_checkpoint(checkpoint: Union[str, Path], out: Union[str, Path], model_config: Optional[Union[str, Path]] = None,
                      prefix: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                      max_shard_size: Union[int, str] = "5GB") -> Path:
    """Write ``checkpoint``'s model as a Hugging Face folder ``out`` (a peft model: its adapter). ``prefix``: where
    the model sits in the LightningModule (default: the record's, or found from ``model_config``, else none)."""
    limit = parse_size(max_shard_size)
    names, record, read = _open(Path(checkpoint))
    described = dict(record.get("pretrained") or {})
    if model_config is not None:
        described.update(_describe_config(Path(model_config), names))
    prefix = described.get("prefix", "") if prefix is None else prefix
    peft = described.get("peft")
    if peft is not None:
        chosen = _adapter_names(names, prefix, peft["adapter"], record.get("trainable"))
    else:
        tied = set(described.get("tied", ()))
        chosen = {n: n[len(prefix):] for n in names if n.startswith(prefix) and n[len(prefix):] not in tied}
        left_out = sorted(n for n in record.get("left_out", ()) if n.startswith(prefix) and n[len(prefix):] not in tied)
        if left_out:
            raise files.CheckpointError(
                f"{str(checkpoint)!r} was saved without its frozen parameters (ShardStrategy(save_frozen=False)):"
                f" {left_out[:4]}{' ...' if len(left_out) > 4 else ''} are not in it, so it cannot make a whole model."
                " Write the folder from the live model (trainer.strategy.save_pretrained), whose base is loaded.")
    if not chosen:
        raise files.CheckpointError(f"{str(checkpoint)!r} holds no weights under prefix {prefix!r}.")
    out = Path(out)
    carried = carried_over(out)
    partial = files.begin(out)
    try:
        writer = SafetensorsWriter(partial, 2**62 if peft is not None else limit,
                                   stem="adapter_model" if peft is not None else "model")
        # fused experts written per expert, as transformers does (the model built on the meta device from its config)
        file_names = conversion.FileNames(conversion.meta_model(described.get("config")) if peft is None else None)
        for batch in _batches(chosen, limit, names):  # a file's worth, read once the last file is out
            writer.make_room(sum(names[n] for n in batch))
            tensors = read(batch)
            for name in batch:  # handed over one by one: nothing here keeps one alive once written
                value = tensors.pop(name)
                value = value.to(dtype if dtype is not None and value.is_floating_point() else value.dtype)
                for file_name, piece in file_names(chosen[name], value.contiguous()):
                    writer.add(file_name, piece)
            del tensors, value, piece
        writer.close()
        for file_name, text in _configs(described, dtype).items():
            (partial / file_name).write_text(text)
        for path in carried:
            shutil.copy2(path, partial / path.name)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    files.commit(partial, out)
    return out


def _adapter_names(names: dict[str, Any], prefix: str, adapter: str, trainable: Optional[list[str]]) -> dict[str, str]:
    chosen = {n: hf.adapter_file_name(n[len(prefix):], adapter) for n in names
              if n.startswith(prefix) and hf.is_adapter_weight(n[len(prefix):], [adapter])}
    others = sorted(set(trainable or ()) - set(chosen))
    if others:
        raise files.CheckpointError(
            f"The checkpoint trained parameters outside the adapter {others[:4]}, which an adapter folder written"
            " from a checkpoint cannot hold: write it from the live model, `trainer.strategy.save_pretrained(folder)`"
            " (peft's own `get_peft_model_state_dict` places them), or export the full model.")
    return chosen


def _batches(chosen: dict[str, str], limit: int, names: dict[str, Any]) -> Iterator[list[str]]:
    """The chosen names in groups of at most ``limit`` bytes (a larger tensor alone)."""
    batch, size = [], 0
    for name in chosen:
        nbytes = names[name]
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += nbytes
    if batch:
        yield batch


def _open(path: Path) -> tuple[dict[str, int], dict[str, Any], Callable[[list[str]], dict[str, Tensor]]]:
    """A sharded directory's or a full file's model weights (name -> bytes), its record, and how to read some."""
    path = files.resolve(path)
    if path.is_file():
        files.verify_full_file(path, alone=True)  # no collective: it may run on one rank of a running job
        loaded = files.load_weights(path, "checkpoint", mmap=True)
        state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else {}
        tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
        names = {k: v.numel() * v.element_size() for k, v in tensors.items()}
        return names, loaded.get(RECORD, {}), lambda batch: {n: tensors[n] for n in batch}
    files.verify_directory(path, alone=True)
    metadata = read_metadata(path).state_dict_metadata
    model = {k[len(MODEL_PREFIX):]: md for k, md in metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    names = {k: md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size() for k, md in model.items()}

    def read(batch: list[str]) -> dict[str, Tensor]:
        tensors = {MODEL_PREFIX + n: torch.empty(model[n].size, dtype=model[n].properties.dtype) for n in batch}
        with warnings.catch_warnings():  # DCP notes it runs without a process group: that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=files.SafeReader(str(path)), no_dist=True)
        return {k[len(MODEL_PREFIX):]: v for k, v in tensors.items()}

    return names, files.load_weights(path / files.META, "checkpoint metadata").get(RECORD, {}), read


def _describe_config(path: Path, names: dict[str, int]) -> dict[str, Any]:
    """A transformers config (a ``config.json`` or its folder): the model's place among ``names``, its tied weights
    and the config's text, from the model built on the meta device."""
    transformers = hf.require("transformers", "exporting with --model-config")
    folder = path if path.is_dir() else path.parent
    config = transformers.AutoConfig.from_pretrained(str(folder))
    architecture = (getattr(config, "architectures", None) or [None])[0]
    cls = hf.architecture_class(config)
    if cls is None:
        raise ValueError(f"{str(path)!r}: its `architectures` ({architecture!r}) names no transformers model class.")
    model = hf.model_on_meta(cls, config)
    keys = list(model.state_dict())
    starts = {n[: len(n) - len(keys[0])] for n in names if n.endswith(keys[0])}
    prefix = next((p for p in sorted(starts, key=len) if all(p + k in names for k in keys if k not in hf.tied_targets(model))),
                  None)
    if prefix is None:
        raise files.CheckpointError(f"The checkpoint does not hold a {architecture} as {str(path)!r} describes it"
                                    f" (no prefix puts {keys[0]!r} and the rest among its names).")
    return {"prefix": prefix, "tied": _dropped_ties(model), "config": config.to_json_string()}


def _configs(described: dict[str, Any], dtype: Optional[torch.dtype]) -> dict[str, str]:
    texts = {}
    if described.get("config"):
        texts["config.json"] = described["config"] if dtype is None else hf.with_dtype(described["config"], dtype)
    if described.get("generation_config"):
        texts["generation_config.json"] = described["generation_config"]
    if described.get("peft"):
        texts = {"adapter_config.json": described["peft"]["config"]}
    return texts


def describe_pretrained(module: Any) -> Optional[dict[str, Any]]:
    """What :func:`export_checkpoint` needs of a module holding a transformers or peft model, for the checkpoint's
    record (plain strings and lists: checkpoints are read with ``weights_only=True``); None unless it holds one."""
    found = hf.find_all_pretrained(module)
    if len(found) != 1:  # none, or several (a teacher and a student): the export needs --prefix / --model-config
        return None
    prefix, model = found[0]
    described: dict[str, Any] = {"prefix": prefix}
    base = model.get_base_model() if hf.is_peft_model(model) else model
    if hf.is_transformers_model(base):
        described["config"] = hf.saved_config(base, hf.floating_dtype(base)).to_json_string()
        generation = getattr(base, "generation_config", None)
        if generation is not None and base.can_generate():
            described["generation_config"] = generation.to_json_string()
    if hf.is_peft_model(model):
        adapter = model.active_adapter
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config[adapter].to_dict().items()}
        described["peft"] = {"adapter": adapter, "config": json.dumps(config, indent=2, sort_keys=True, default=str)}
    else:
        described["tied"] = _dropped_ties(model)
    return described


def _dropped_ties(model: Any) -> list[str]:
    """Of each group of tied weights, the names a file leaves out: the model's tie targets, else all but the first."""
    targets = hf.tied_targets(model)
    dropped = []
    for names in (n for n in hf.names_per_parameter(model) if len(n) > 1):
        kept = [n for n in names if n not in targets][:1] or names[:1]
        dropped += [n for n in names if n not in kept]
    return sorted(dropped)
