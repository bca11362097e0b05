"""peft adapters on a model built on the meta device: what materialising one unit at a time cannot give them.

* LoRA's own init (``B`` at zero, so that the adapted model starts as its base), where materialising gave the
  adapters' modules their generic init (:func:`init_peft_adapters`).
* DoRA's magnitudes, ``||W + scaling * B A||`` row by row, which peft computes from the base weight when the adapter is
  made: built on the meta device, the base has no values then. They get a placeholder as the model is materialised
  (:func:`prepare_dora_on_meta`), and their values from the base once it has some (:func:`init_dora_magnitudes`): after
  the materialised init, and again when ``load_pretrained`` fills the base from a folder, as ``get_peft_model`` on the
  loaded base computes them. Each unit holding DoRA layers is gathered in turn for it (rank 0's values kept).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_shard.checkpoint.hf import adapter_names, find_all_pretrained, is_peft_model


def init_peft_adapters(runtime: Any) -> list[str]:
    """peft's own init for the adapters of a peft model built on the meta device (LoRA's ``B`` at zero, so that the
    adapted model starts as its base), which materialising gave their modules' generic init instead; the names of
    the weights set. Every rank must call it (rank 0's values are broadcast). Inits that read the base weights
    (PiSSA, OLoRA, LoftQ, ...) are refused: load the adapter instead."""
    from lightning_shard.checkpoint.full import registered
    from lightning_shard.checkpoint.sources import TensorSource
    from lightning_shard.checkpoint.weights import load_into
    from lightning_shard.engine.comm import collectives

    slots = {name: slot for unit in runtime.units for slot in unit.storage.slots for name in slot.names}
    values: dict[str, Any] = {}
    for prefix, model, path, layer in ((p, m, path, layer) for p, m in find_all_pretrained(runtime.root)
                                       if is_peft_model(m) for path, layer in m.named_modules()):
        if not hasattr(layer, "reset_lora_parameters"):
            continue
        for adapter in adapter_names(model):
            init = model.peft_config[adapter].init_lora_weights
            if init is False:  # peft keeps its modules' own init: what materialising gave them
                continue
            if init not in (True, "gaussian"):
                raise ValueError(f"lightning_shard: a peft model built on the meta device gets peft's init for its"
                                 f" adapters at setup; init_lora_weights={init!r} reads the base weights, which"
                                 " are not loaded yet. Load the adapter (load_pretrained of an adapter folder) or"
                                 " use init_lora_weights=True.")
            names = [n for n, _ in layer.named_parameters() if adapter in n.split(".")]
            full = {n: torch.zeros(slots[f"{prefix}{path}.{n}"].shape) for n in names}
            with registered([(slots[f"{prefix}{path}.{n}"], nn.Parameter(v)) for n, v in full.items()]):
                layer.reset_lora_parameters(adapter, init)
            values.update({f"{prefix}{path}.{n}": v for n, v in full.items()})
    if not values:
        return []
    device = runtime.units[0].storage.device
    flat = torch.cat([v.reshape(-1) for v in values.values()]).to(device)
    if runtime.world_size > 1:  # the random draws of rank 0, on every rank
        flat = collectives.broadcast(flat, runtime.group, runtime.stats, label="broadcast of the adapters' init")
    flat = flat.cpu().split([v.numel() for v in values.values()])
    values = {name: piece.view(v.shape) for (name, v), piece in zip(values.items(), flat)}
    load_into(runtime, TensorSource(values), strict=False, not_expected=lambda n: n not in values)
    return sorted(values)


def dora_layers(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Each (peft LoRA layer, adapter) that uses DoRA."""
    return [(layer, adapter) for _, layer in module.named_modules()
            for adapter, dora in getattr(layer, "use_dora", {}).items()
            if dora and adapter in getattr(layer, "lora_magnitude_vector", {})]


def prepare_dora_on_meta(module: nn.Module) -> list[nn.Module]:
    """Give each DoRA magnitude still on the meta device a placeholder init (ones), which materialising runs in place of
    the ``reset_parameters()`` peft's magnitude layers lack; :func:`init_dora_magnitudes` computes their values.
    Returns the magnitude layers given one (take it back with :func:`forget_placeholders`)."""
    layers = []
    for layer, adapter in dora_layers(module):
        magnitude = layer.lora_magnitude_vector[adapter]
        if magnitude.weight.is_meta and "reset_parameters" not in magnitude.__dict__:
            magnitude.reset_parameters = _ones(magnitude)
            layers.append(magnitude)
    return layers


def forget_placeholders(layers: list[nn.Module]) -> None:
    for magnitude in layers:
        magnitude.__dict__.pop("reset_parameters", None)


def _ones(magnitude: nn.Module):
    def reset_parameters() -> None:
        with torch.no_grad():
            magnitude.weight.fill_(1.0)

    return reset_parameters


def magnitudes_from_base(module: nn.Module, runtime: Any = None) -> int:
    """DoRA's magnitudes of ``module`` computed by peft from its base weights as they are now (``runtime``: the one
    sharding it, or None). Returns how many (0: no DoRA layer)."""
    if runtime is not None:
        return init_dora_magnitudes(runtime, module)
    layers = dora_layers(module)
    with torch.no_grad():
        for layer, adapter in layers:
            _update(layer, adapter)
    return len(layers)


def _update(layer: nn.Module, adapter: str) -> None:
    magnitude = layer.lora_magnitude_vector[adapter]
    trains = magnitude.weight.requires_grad
    magnitude.update_layer(base_layer=layer.get_base_layer(), lora_A=layer.lora_A[adapter].weight,
                           lora_B=layer.lora_B[adapter].weight, scaling=layer.scaling[adapter])
    magnitude.weight.requires_grad_(trains)  # (peft's new Parameter trains; a frozen one stays frozen)


def init_dora_magnitudes(runtime: Any, module: nn.Module) -> int:
    """DoRA's magnitudes of ``module`` (sharded by ``runtime``) computed by peft from the base weights as they are now,
    each unit holding some gathered in turn (every rank must call it; rank 0's values kept). Returns how many."""
    layers = dora_layers(module)
    if not layers:
        return 0
    owner = {id(p): unit for unit in runtime.units for p in (*unit.storage.shard_params, *unit.storage.gathered_params)}
    by_unit: dict[int, tuple[Any, list]] = {}
    for layer, adapter in layers:
        unit = owner[id(layer.lora_magnitude_vector[adapter].weight)]
        by_unit.setdefault(id(unit), (unit, []))[1].append((layer, adapter))
    for unit, members in by_unit.values():
        with runtime.keep_gathered(modifier_rank=0, units=[unit]), torch.no_grad():
            for layer, adapter in members:
                _update(layer, adapter)
    return len(layers)
