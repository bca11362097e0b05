"""Weight sources (a state dict, a torch file, a safetensors file) copied into a sharded model from a full state dict, a torch file or a safetensors file, each rank
reading only the slices its shards own: no rank ever holds the whole model.

A torch file is memory-mapped (pages are read as slices touch them); a safetensors file is read slice by
slice (whole rows of a parameter, trimmed to the rank's range). Both are read with no unpickling of code.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor

from lightning_shard.checkpoint.files import CheckpointError, load_weights
from lightning_shard.engine.hooks import ShardRuntime


class TensorSource:
    """Full tensors already at hand (possibly memory-mapped)."""

    def __init__(self, state: Mapping[str, Tensor]) -> None:
        self.state = state

    def names(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> torch.Size:
        return self.state[name].shape

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        return self.state[name].reshape(-1)[lo:hi]

    def whole(self, name: str) -> Tensor:
        return self.state[name]


class SafetensorsSource:
    """A safetensors file, read by slices of whole rows."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def names(self) -> set[str]:
        return set(self.handle.keys())

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.handle.get_slice(name).get_shape())

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        shape = self.shape(name)
        if len(shape) < 2 or lo >= hi:
            return self.whole(name).reshape(-1)[lo:hi]
        row = math.prod(shape[1:])
        first, end = lo // row, -(-hi // row)
        rows = self.handle.get_slice(name)[first:end]
        return rows.reshape(-1)[lo - first * row : hi - first * row]

    def whole(self, name: str) -> Tensor:
        return self.handle.get_tensor(name)


@contextmanager
def open_weights(path: Union[str, Path]) -> Iterator[Union[TensorSource, SafetensorsSource]]:
    """A ``.safetensors`` file, or a torch file holding a state dict (or a Lightning checkpoint's)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as handle:
            yield SafetensorsSource(handle)
        return
    loaded = load_weights(path, "weights file", mmap=True)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, Tensor) for v in loaded.values()):
        raise CheckpointError(f"{str(path)!r} does not hold a state dict of tensors.")
    yield TensorSource(loaded)


@torch.no_grad()
def load_into(runtime: ShardRuntime, source: Union[TensorSource, SafetensorsSource], strict: bool = True,
              prefix: str = "") -> tuple[list[str], list[str]]:
    """Copy ``source`` into the sharded model; model name = ``prefix`` + source name. Returns (missing,
    unexpected) like ``load_state_dict``; with ``strict`` either raises, as does any shape mismatch."""
    available = source.names()
    slots = [(unit, slot, param) for unit in runtime.units
             for slot, param in zip(unit.storage.slots, unit.storage.shard_params)]
    param_names = {name for _, slot, _ in slots for name in slot.names}
    buffers = {k: v for k, v in runtime.root.state_dict().items() if k.startswith(prefix) and k not in param_names}
    wanted = {name for name in param_names if name.startswith(prefix)} | set(buffers)
    unexpected = sorted(n for n in available if prefix + n not in wanted)
    missing = []
    for _, slot, _ in slots:
        names = [n[len(prefix):] for n in slot.names if n.startswith(prefix)]
        if names and not any(n in available for n in names):  # any one name of tied weights will do
            missing.append(prefix + names[0])
    missing += [b for b in buffers if b[len(prefix):] not in available]
    if strict and (missing or unexpected):
        raise CheckpointError(f"The weights do not fit the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''},"
                              f" unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}.")
    for unit, slot, param in slots:
        name = next((n[len(prefix):] for n in slot.names if n.startswith(prefix) and n[len(prefix):] in available), None)
        if name is None:
            continue
        if source.shape(name) != slot.shape:
            raise CheckpointError(f"Shape mismatch for {prefix + name!r}: weights {tuple(source.shape(name))},"
                                  f" model {tuple(slot.shape)}.")
        param.copy_(source.read(name, *unit.storage.param_range(slot, unit.storage.rank)))
    for name, buffer in buffers.items():
        if name[len(prefix):] in available:
            buffer.copy_(source.whole(name[len(prefix):]))
    runtime.refresh_gathered()
    return missing, unexpected
