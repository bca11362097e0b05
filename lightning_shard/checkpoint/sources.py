"""Where weights come from, each read by slices (so a rank reads only what its shards own) and without unpickling
code: a state dict at hand, a torch file (memory-mapped), a safetensors file (slices of whole rows), and Hugging
Face folders: a model (``config.json`` with ``model.safetensors``, or ``model.safetensors.index.json`` and its
shards; ``pytorch_model.bin`` likewise) or a peft adapter (``adapter_config.json`` with
``adapter_model.safetensors`` or ``.bin``).

Every source offers ``names()``, ``shape(name)``, ``read(name, lo, hi)`` (flat elements ``[lo, hi)``),
``whole(name)``, ``value(name)`` (what load hooks are given) and ``metadata`` (a state dict's ``_metadata``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor

from lightning_shard.checkpoint.files import CheckpointError, load_weights


class TensorSource:
    """Full tensors already at hand (possibly memory-mapped)."""

    def __init__(self, state: Mapping[str, Tensor]) -> None:
        self.state = state
        self.metadata = getattr(state, "_metadata", None)  # what nn.Module.state_dict() records per module

    def names(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> torch.Size:
        return self.state[name].shape

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        return self.state[name].reshape(-1)[lo:hi]

    def whole(self, name: str) -> Tensor:
        return self.state[name]

    def value(self, name: str) -> Any:
        """What the model's load hooks get under ``name``."""
        return self.state[name]


class SafetensorsSource:
    """A safetensors file, read by slices of whole rows."""

    metadata = None

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

    def value(self, name: str) -> Tensor:
        """What the model's load hooks get under ``name``: a meta tensor of its shape and dtype (read later)."""
        dtype = _SAFETENSORS_DTYPES.get(self.handle.get_slice(name).get_dtype(), torch.float32)
        return torch.empty(self.shape(name), dtype=dtype, device="meta")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class FilesSource:
    """Several files read as one (an HF folder's shards): each name from the file that holds it."""

    metadata = None

    def __init__(self, by_name: Mapping[str, Any]) -> None:
        self.by_name = by_name

    def names(self) -> set[str]:
        return set(self.by_name)

    def shape(self, name: str) -> torch.Size:
        return self.by_name[name].shape(name)

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        return self.by_name[name].read(name, lo, hi)

    def whole(self, name: str) -> Tensor:
        return self.by_name[name].whole(name)

    def value(self, name: str) -> Any:
        return self.by_name[name].value(name)


class RenamedSource:
    """``source`` under other names: ``renamed`` maps each new name to the source's."""

    def __init__(self, source: Any, renamed: Mapping[str, str]) -> None:
        self.source, self.renamed = source, dict(renamed)
        self.metadata = None  # recorded under the old names

    def names(self) -> set[str]:
        return set(self.renamed)

    def shape(self, name: str) -> torch.Size:
        return self.source.shape(self.renamed[name])

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        return self.source.read(self.renamed[name], lo, hi)

    def whole(self, name: str) -> Tensor:
        return self.source.whole(self.renamed[name])

    def value(self, name: str) -> Any:
        return self.source.value(self.renamed[name])


class RoundedSource:
    """``source`` with some names' floating values rounded to a dtype first (``rounded``: name -> dtype), as
    ``from_pretrained`` loads a weight into a bf16 model before anything casts it on."""

    def __init__(self, source: Any, rounded: Mapping[str, torch.dtype]) -> None:
        self.source, self.rounded = source, dict(rounded)
        self.metadata = source.metadata

    def names(self) -> set[str]:
        return self.source.names()

    def shape(self, name: str) -> torch.Size:
        return self.source.shape(name)

    def read(self, name: str, lo: int, hi: int) -> Tensor:
        return self._rounded(name, self.source.read(name, lo, hi))

    def whole(self, name: str) -> Tensor:
        return self._rounded(name, self.source.whole(name))

    def value(self, name: str) -> Any:
        return self.source.value(name)

    def _rounded(self, name: str, value: Tensor) -> Tensor:
        dtype = self.rounded.get(name)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value


ADAPTER_CONFIG = "adapter_config.json"
_MODEL_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")
_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def weight_files(folder: Path) -> list[Path]:
    """The weight files of an HF model or peft adapter folder, or an error naming what a folder must hold."""
    names = _ADAPTER_FILES if (folder / ADAPTER_CONFIG).is_file() else _MODEL_FILES
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        index = json.loads(path.read_text())
        shards = sorted(set(index.get("weight_map", {}).values()))
        absent = [s for s in shards if not (folder / s).is_file()]
        if absent or not shards:
            raise CheckpointError(f"{str(path)!r} lists shards that are not in the folder: {absent[:4] or 'none'}.")
        return [folder / s for s in shards]
    raise CheckpointError(f"{str(folder)!r} holds no weights: a Hugging Face model folder has one of"
                          f" {list(_MODEL_FILES)}, a peft adapter folder {ADAPTER_CONFIG} and one of {list(_ADAPTER_FILES)}.")


@contextmanager
def open_weights(path: Union[str, Path]) -> Iterator[Any]:
    """A ``.safetensors`` file, a torch file holding a state dict (or a Lightning checkpoint's), or a folder of
    either (HF model or peft adapter)."""
    path = Path(path)
    if not path.is_dir():
        with ExitStack() as stack:
            yield _open_file(path, stack)
        return
    with ExitStack() as stack:
        by_name: dict[str, Any] = {}
        for file in weight_files(path):
            source = _open_file(file, stack)
            by_name.update(dict.fromkeys(source.names(), source))
        yield FilesSource(by_name)


def _open_file(path: Path, stack: ExitStack) -> Any:
    if not path.exists():
        raise CheckpointError(f"{str(path)!r} does not exist.")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        return SafetensorsSource(stack.enter_context(safe_open(str(path), framework="pt", device="cpu")))
    loaded = load_weights(path, "weights file", mmap=True)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, Tensor) for v in loaded.values()):
        raise CheckpointError(f"{str(path)!r} does not hold a state dict of tensors.")
    return TensorSource(loaded)
