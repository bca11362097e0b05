"""Turn a sharded checkpoint directory into one ordinary Lightning checkpoint file.

    python -m lightning_shard.consolidate CKPT_DIR [OUT.ckpt]

The result is what ``state_dict_type="full"`` would have written: ``state_dict`` loads into the plain
LightningModule (``load_state_dict`` or ``load_from_checkpoint``), ``optimizer_states`` are ordinary
``Optimizer.state_dict()``s, and ``trainer.fit(ckpt_path=OUT.pt)`` resumes from it. Runs in one process and
runs no collective, also on one rank of a running job (``if trainer.is_global_zero: consolidate(path)``), whatever
the other ranks do meanwhile; it needs memory for the whole model (that is the point of the output).

Ours, not ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: that writes DCP's flat keys, while a
Lightning checkpoint needs ordinary optimizer states and ``meta.pt`` put back together, with our manifest checked.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_shard.checkpoint import files
from lightning_shard.checkpoint.sharded import CURRENT_PREFIX, MODEL_PREFIX, optimizer_prefix, read_metadata


def consolidate(directory: Union[str, Path], out: Optional[Union[str, Path]] = None,
                model: Optional[nn.Module] = None) -> dict[str, Any]:
    """Read a sharded checkpoint whole; write it to ``out`` (atomically) if given; return it.

    A sharded checkpoint names parameters as ``named_parameters()`` does, not as the model's state-dict hooks
    would. Pass the plain (unsharded) ``model`` whose checkpoint it is and ``state_dict`` comes out of its
    ``state_dict()``, hooks and all, with the checkpoint's tensors put in its place (it keeps them): the keys
    ``state_dict_type="full"`` writes. Without it the keys are the checkpoint's, right only for a model with
    no renaming state-dict hooks.
    """
    directory = files.resolve(Path(directory))
    if directory.is_file():
        raise files.CheckpointError(f"{str(directory)!r} is a file, not a sharded checkpoint directory (a"
                                    " full checkpoint file needs no consolidation).")
    files.verify_directory(directory, alone=True)  # no collective: it may run on one rank of a running job
    metadata = read_metadata(directory)
    tensors = {key: torch.empty(md.size, dtype=md.properties.dtype)
               for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP notes it runs without a process group: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=files.SafeReader(str(directory)), no_dist=True)

    checkpoint = files.load_weights(directory / files.META, "checkpoint metadata")
    # current_model_state: the weights trained, where state_dict holds their average (``model`` keeps state_dict's)
    for key, prefix in (("current_model_state", CURRENT_PREFIX), ("state_dict", MODEL_PREFIX)):
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if state or key == "state_dict":
            checkpoint[key] = state if model is None else _through_hooks(model, state)
    if "optimizer_states" in checkpoint:  # (a weights-only checkpoint has none)
        checkpoint["optimizer_states"] = [_full_optimizer_state(tensors, optimizer_prefix(i), saved)
                                          for i, saved in enumerate(checkpoint["optimizer_states"])]
    if out is not None:
        out = Path(out)
        partial = files.partial_path(out)
        torch.save(checkpoint, partial)
        files.commit(partial, out)
    return checkpoint


def _through_hooks(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``model.state_dict()`` once its parameters and buffers are ``state``'s tensors. A buffer may be saved
    under its hooked name (the sharded model's ``state_dict()`` key), found through the tensor it stands for."""
    hooked = {id(v): k for k, v in model.state_dict(keep_vars=True).items()}
    made: dict[int, nn.Parameter] = {}  # one new Parameter per original: ties stay ties
    for (name, tensor), kind in [*((p, "_parameters") for p in model.named_parameters(remove_duplicate=False)),
                                 *((b, "_buffers") for b in model.named_buffers(remove_duplicate=False))]:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if kind == "_buffers" and attr in module._non_persistent_buffers_set:
            continue
        value = made[id(tensor)] if id(tensor) in made else state.get(name, state.get(hooked.get(id(tensor), "")))
        if value is None:
            raise files.CheckpointError(f"The checkpoint holds no {name!r}: it is not a checkpoint of this model.")
        if kind == "_parameters" and id(tensor) not in made:
            value = made[id(tensor)] = nn.Parameter(value, requires_grad=tensor.requires_grad)
        getattr(module, kind)[attr] = value
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}


def _full_optimizer_state(tensors: dict[str, torch.Tensor], prefix: str, saved: dict[str, Any]) -> dict[str, Any]:
    """Back to torch's format: parameters numbered in the order of the optimizer's groups."""
    order = [name for group in saved["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith(prefix):
            name, state_key = key[len(prefix):].rsplit(".", 1)
            state.setdefault(index[name], {})[state_key] = value
    for name, other in saved["other"].items():
        state.setdefault(index[name], {}).update(other)
    groups = [{**group, "params": [index[n] for n in group["params"]]} for group in saved["param_groups"]]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def default_out(directory: Union[str, Path]) -> Path:
    """``epoch=1-step=24.ckpt`` (a directory) -> ``epoch=1-step=24.full.ckpt`` beside it."""
    directory = Path(directory)
    return directory.with_name(f"{directory.stem if directory.suffix == '.ckpt' else directory.name}.full.ckpt")
