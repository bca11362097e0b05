"""A trained module, sharded or not, written as a Hugging Face folder that ``from_pretrained`` loads.

* a transformers model (or any module): its weights in safetensors files of at most ``max_shard_size`` bytes
  (``model.safetensors``, or numbered files and ``model.safetensors.index.json``) under the model's own names,
  one name per tied weight, and its ``config.json`` (and ``generation_config.json``) when it has them;
* a peft model: by default its adapter alone (``adapter_model.safetensors`` and ``adapter_config.json``, what
  ``PeftModel.from_pretrained(base, folder)`` loads); ``merged=True`` writes the base model with the adapter
  merged into its weights instead (LoRA's ``get_delta_weight``), a folder ``from_pretrained`` loads as the base.
* 4-bit weights (bitsandbytes, QLoRA) are written dequantized, in the dtype they were quantized from (merged with
  their adapter where there is one), and the config without its ``quantization_config``: a folder of ordinary
  weights (``dtype=torch.bfloat16`` writes every weight in bf16).

Every rank must call it on a sharded module: units are gathered one at a time (an adapter's weights alone, not
the units around them), and rank 0 writes. No process holds more than a unit and one file's tensors, and never the
optimizer state. The folder is written beside the target and renamed into place when complete.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import nullcontext
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shard.checkpoint import conversion, files, hf
from lightning_shard.checkpoint.full import gather_slots, registered
from lightning_shard.checkpoint.quantized_export import Dequantizer
from lightning_shard.checkpoint.safetensors_writer import SafetensorsWriter, parse_size
from lightning_shard.engine.comm import collectives
from lightning_shard.engine.shard_module import sharded_root_of
from lightning_shard.engine.storage.flat_shard import ParamSlot


def save_pretrained(module: nn.Module, folder: Union[str, Path], dtype: Optional[torch.dtype] = None,
                    max_shard_size: Union[int, str] = "5GB", merged: bool = False, prefix: Optional[str] = None,
                    adapter: Optional[str] = None) -> Path:
    """Write ``module`` into ``folder`` (see the module's note). ``dtype``: the files' floating dtype (default: the
    weights' own, fp32 masters under mixed precision). ``prefix``: where the model to export sits in ``module``
    (default: the transformers or peft model found in it, else all of ``module``). ``adapter``: a peft model's
    adapter to write (default: the active one)."""
    limit = parse_size(max_shard_size)
    runtime, at = sharded_root_of(module)
    if at:  # a module inside a sharded model (a LightningModule's self.model): exported from the root, under its prefix
        inner = prefix if prefix is not None else (hf.find_pretrained(module) or ("", module))[0]
        module, prefix = runtime.root, at + inner
    if prefix is None:
        prefix, model = hf.find_pretrained(module) or ("", module)
    else:
        model = module.get_submodule(prefix[:-1]) if prefix else module
    if hf.is_peft_model(model):
        adapter = adapter or model.active_adapter
        if adapter not in hf.adapter_names(model):
            raise ValueError(f"save_pretrained: the peft model has no adapter {adapter!r} (it has"
                             f" {hf.adapter_names(model)}).")
        hf.require("peft", "exporting a peft model")
    elif merged:
        raise ValueError("save_pretrained: `merged=True` merges a peft model's adapter; this model has none.")
    layers = _lora_layers(model, adapter) if merged else {}  # refusals first, on every rank, before any exchange
    folder = Path(folder)
    runtime = getattr(module, "_shard_runtime", None)
    if runtime is not None:
        runtime.adopt_rebound_shards()  # (the buffers written are rank 0's own: rank 0 writes)
    writing = not dist.is_initialized() or dist.get_rank() == 0
    carried, refusal = [], None
    if writing:
        try:
            carried = carried_over(folder)
        except ValueError as err:
            refusal = str(err)
    refusal = collectives.from_every_rank(refusal)[0]  # rank 0's folder: every rank stops, or none
    if refusal is not None:
        raise ValueError(refusal)
    partial = files.begin(folder) if writing else None
    try:
        if hf.is_peft_model(model) and not merged:
            _write_adapter(module, model, prefix, adapter, partial, dtype)
        elif partial is None:
            for _ in _parameters(module):  # the pieces the writing rank needs
                pass
        else:
            writer = SafetensorsWriter(partial, limit)
            file_names = conversion.FileNames(model)  # fused experts written per expert, as transformers does
            for name, tensor in _Exporter(module, model, prefix, adapter if merged else None, layers, dtype,
                                          writer.make_room).tensors():
                for file_name, piece in file_names(name, tensor):
                    writer.add(file_name, piece)
                del tensor, piece  # the writer's alone: written out, it is freed before the next one is gathered
            writer.close()
            _write_configs(model.get_base_model() if merged else model, partial, dtype)  # (no quantization_config)
        for path in carried:
            shutil.copy2(path, partial / path.name)
    except BaseException:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if partial is not None:
        files.commit(partial, folder)
    if dist.is_initialized():
        dist.barrier()  # the folder is complete for every rank once it returns
    return folder


# what an export writes (a folder's earlier export is replaced), and what may lie beside it (a tokenizer, custom
# modelling code: carried over)
_WRITTEN = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
            "pytorch_model*.bin", "pytorch_model.bin.index.json", "adapter_config.json", "adapter_model.*")
_BESIDE = ("*.json", "*.txt", "*.model", "*.py", "*.md", "*.tiktoken", "*.jinja")


def carried_over(folder: Path) -> list[Path]:
    """The files of an existing ``folder`` that the new export keeps (copied into it), or an error naming what a
    folder a model is written into must not hold: it is replaced whole, so that it is complete or not at all."""
    if not folder.exists():
        return []
    if not folder.is_dir():
        raise ValueError(f"lightning_shard: {str(folder)!r} is a file, not a folder.")
    entries = list(folder.iterdir())
    foreign = [p.name for p in entries if p.is_dir() or not any(fnmatch(p.name, pattern) for pattern in _WRITTEN + _BESIDE)]
    if foreign:
        raise ValueError(f"lightning_shard: {str(folder)!r} holds {sorted(foreign)[:5]}, which a model folder does not:"
                         " the folder is replaced whole when the export is complete. Write into a new or empty"
                         " folder (a tokenizer's files, configs and modelling code beside the weights are kept).")
    return [p for p in entries if not any(fnmatch(p.name, pattern) for pattern in _WRITTEN)]


def _parameters(module: nn.Module, before: Callable[[int], None] = lambda nbytes: None
                ) -> Iterator[tuple[ParamSlot, Optional[Tensor]]]:
    """Each parameter with its full master value (rank 0; None elsewhere), one at a time: a sharded module's
    pieces sent to rank 0 straight into the tensor that holds it (``before(bytes)`` is told its size first), an
    unsharded module's as they are. Every rank must iterate (ranks of other replicas have nothing to send)."""
    runtime = getattr(module, "_shard_runtime", None)
    if runtime is None:
        by_id: dict[int, tuple[list[str], nn.Parameter]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), ([], param))[0].append(name)
        for names, p in by_id.values():
            yield ParamSlot(tuple(names), (), p.shape, 0, p.numel(), p.requires_grad), p.detach()
        return
    writing = not dist.is_initialized() or dist.get_rank() == 0
    if 0 not in runtime.shard_group_ranks:
        return  # another replica's ranks: rank 0's shard group sends everything
    for unit in runtime.units:
        storage = unit.storage
        for slot, shard in zip(storage.slots, storage.shard_params):
            full = None
            if writing:
                before(slot.numel * shard.element_size())
                full = torch.empty(slot.shape, dtype=shard.dtype, device=storage.shard.device)
            if storage.world_size == 1:
                if full is not None:
                    full.view(-1).copy_(shard.detach())
            else:
                bounds = [storage.param_range(slot, r) for r in range(storage.world_size)]
                collectives.gather_pieces(full.view(-1) if full is not None else None, shard.detach(), bounds,
                                          runtime.groups.shard, runtime.stats,
                                          label=f"gather of {slot.names[0]!r} for save_pretrained")
            yield slot, (full.cpu() if full is not None else None)


class _Exporter:
    """The weights ``from_pretrained`` expects, named as the model names them, one name per tied weight; with a
    peft ``adapter`` to merge, each wrapped layer's base weight once its adapter's weights have come too."""

    def __init__(self, module: nn.Module, model: nn.Module, prefix: str, adapter: Optional[str],
                 layers: dict[str, Any], dtype: Optional[torch.dtype], make_room: Callable[[int], None]) -> None:
        self.module, self.model, self.prefix, self.adapter, self.dtype = module, model, prefix, adapter, dtype
        self.make_room = make_room  # the writer's: a parameter is gathered once the file before it is out
        self.tied = hf.tied_targets(model)
        self.layers = layers
        self.held: dict[str, tuple[ParamSlot, Tensor]] = {}  # what a layer still waiting for its adapter needs
        self.packed = Dequantizer()  # 4-bit weights are written dequantized, merged or not

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        for packed_slot, packed_value in _parameters(self.module, self.make_room):
            slot, value = self.packed.take(packed_slot, packed_value)
            if slot is None:
                continue  # a 4-bit weight waiting for its quantization state, or a part of that state
            names = [n[len(self.prefix):] for n in slot.names if n.startswith(self.prefix)]
            if not names:
                continue  # not the exported model's (a LightningModule's own head, say)
            waiting = [n for n in names if n in self.layers.get("needs", {})]
            if waiting:
                self.held[waiting[0]] = (slot, value)
                yield from self._merge_ready()
                continue
            name = self._file_name(names)
            if name is not None:
                yield name, self._cast(value)
            del value  # before the next one is gathered
        self.packed.check_done()
        if self.layers.get("needs") and len(self.held) != 0:
            raise RuntimeError(f"save_pretrained: merging stopped at {sorted(self.held)[:4]}: a LoRA layer's weights"
                               " were not all found.")
        yield from self._buffers()

    def _file_name(self, names: list[str]) -> Optional[str]:
        if self.adapter is not None:  # merging: the base model's names
            names = [m for m in (hf.merged_name(n, self.adapter) for n in names) if m is not None]
            if not names:
                return None  # merged into a base weight, or replaced by a trained copy
        untied = [n for n in names if n not in self.tied]
        return (untied or names)[0]

    def _merge_ready(self) -> Iterator[tuple[str, Tensor]]:
        for path, (layer, needs, base_name) in list(self.layers["by_layer"].items()):
            if all(n in self.held for n in needs):
                values = [self.held.pop(n) for n in needs]
                with registered([(slot, nn.Parameter(v, requires_grad=False)) for slot, v in values]):
                    base = _base_param(layer)
                    # as peft's merge (`weight.data += delta`): added in the wider dtype, rounded once
                    merged = (base + layer.get_delta_weight(self.adapter)).to(base.dtype)
                del self.layers["by_layer"][path]
                yield hf.base_name(f"{path}.{base_name}" if path else base_name), self._cast(merged)

    def _buffers(self) -> Iterator[tuple[str, Tensor]]:
        for owner, sub in self.model.named_modules():
            for attr, buffer in sub._buffers.items():
                if buffer is not None and attr not in sub._non_persistent_buffers_set:
                    name = f"{owner}.{attr}" if owner else attr
                    name = hf.merged_name(name, self.adapter) if self.adapter is not None else name
                    if name is not None:
                        yield name, self._cast(buffer)

    def _cast(self, value: Tensor) -> Tensor:
        """On the CPU in the files' dtype, in a storage of its own (safetensors refuses tensors sharing one)."""
        dtype = self.dtype if self.dtype is not None and value.is_floating_point() else value.dtype
        if value.device.type == "cpu" and value.dtype == dtype and value.is_contiguous() \
                and value.untyped_storage().nbytes() == value.numel() * value.element_size():
            return value  # fresh from _parameters: no second copy
        return value.to("cpu", dtype=dtype, copy=True).contiguous()


def _lora_layers(model: nn.Module, adapter: Optional[str]) -> dict[str, Any]:
    """The peft layers to merge: per layer (by its path in ``model``) the layer and the names (relative to
    ``model``) of its base weight and of the adapter's weights; ``needs``: all those names. Refused here, on every
    rank: DoRA, and a merge into a tied weight (it would untie it)."""
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    by_layer: dict[str, tuple[nn.Module, list[str], str]] = {}
    for path, layer in model.named_modules():
        if not (hasattr(layer, "get_delta_weight") and hasattr(layer, "get_base_layer")):
            continue
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise ValueError(f"save_pretrained: `merged=True` merges LoRA adapters; {path!r} uses DoRA. Merge with"
                             " peft (`merge_and_unload`) in one process, or export the adapter alone.")
        # the weight it adapts: a layer's own, or a parameter (peft's `target_parameters`, LoRA on fused experts,
        # whose wrappers nest: each merges its adapter's weights, not those of the wrappers inside it)
        base_param = _base_param(layer)
        base_name = next((n for n, p in layer.named_parameters() if p is base_param), "base_layer.weight")
        own = [f"{path}.{n}" if path else n for n, _ in layer.named_parameters()
               if (adapter in n.split(".") and not n.startswith("base_layer.")) or n == base_name]
        if len(own) < 2:
            continue
        base = tied.get(id(base_param), [])
        if len(base) > 1:
            raise ValueError(f"save_pretrained: `merged=True` would merge the adapter of {path!r} into a weight tied"
                             f" to {[n for n in base if not n.startswith(path)][:2]}, untying them. Export the"
                             " adapter alone (the default), or merge with peft in one process.")
        by_layer[path] = (layer, own, base_name)
    return {"by_layer": by_layer, "needs": {n for _, own, _ in by_layer.values() for n in own}}


def _base_param(layer: nn.Module) -> Optional[Tensor]:
    """The weight a peft layer adapts: its base layer's ``weight``, or the parameter peft's ``ParamWrapper`` names."""
    name = getattr(layer, "parameter_name", None)
    return getattr(layer.get_base_layer(), name or "weight", None)


def _write_adapter(module: nn.Module, model: nn.Module, prefix: str, adapter: str, folder: Optional[Path],
                   dtype: Optional[torch.dtype]) -> None:
    """The adapter's weights (and what peft saves beside them: trainable biases, ``modules_to_save``), gathered
    without the base weights around them, through peft's own ``get_peft_model_state_dict``."""
    from peft import get_peft_model_state_dict

    wanted = lambda name, trainable: trainable or hf.is_adapter_weight(name, [adapter])
    runtime = getattr(module, "_shard_runtime", None)
    gathered: list[tuple[ParamSlot, Tensor]] = []  # full values, registered in the tree while peft reads them
    if runtime is None:
        state = {n: p.detach() for n, p in model.named_parameters() if wanted(n, p.requires_grad)}
    else:
        state = {}
        for unit in runtime.units:
            storage = unit.storage
            chosen = [i for i, (slot, shard) in enumerate(zip(storage.slots, storage.shard_params))
                      if any(n.startswith(prefix) and wanted(n[len(prefix):], shard.requires_grad) for n in slot.names)]
            if chosen:
                for i, value in zip(chosen, gather_slots(runtime, storage, chosen)):
                    gathered.append((storage.slots[i], value))
                    state.update({n[len(prefix):]: value for n in storage.slots[i].names if n.startswith(prefix)})
    if folder is None:
        return
    # peft asks some modules for their own state_dict() (a `modules_to_save` copy): they hold full values then
    with registered([(slot, nn.Parameter(v, requires_grad=False)) for slot, v in gathered]), \
            (runtime.plain_state_dict() if runtime is not None else nullcontext()):
        adapter_state = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter,
                                                  save_embedding_layers=False)
    writer = SafetensorsWriter(folder, 2**62, stem="adapter_model")
    for name, value in adapter_state.items():
        dtype_ = dtype if dtype is not None and value.is_floating_point() else value.dtype
        writer.add(name, value.to("cpu", dtype=dtype_, copy=True).contiguous())
    writer.close()
    model.peft_config[adapter].save_pretrained(str(folder))


def _write_configs(model: nn.Module, folder: Path, dtype: Optional[torch.dtype]) -> None:
    config = getattr(model, "config", None)
    if hf.is_transformers_model(model) and config is not None:
        saved = hf.saved_config(model, dtype or hf.floating_dtype(model))
        if getattr(saved, "quantization_config", None) is not None:  # its weights are written dequantized
            del saved.quantization_config
        saved.save_pretrained(str(folder))
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(str(folder))
