"""Tensors streamed into safetensors files the way Hugging Face lays them out: files of at most ``max_shard_size``
bytes (a larger tensor gets a file of its own), named ``model-00001-of-00003.safetensors`` with
``model.safetensors.index.json`` mapping each name to its file, or one ``model.safetensors``. Only the tensors of
the file being filled are held."""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path
from typing import Union

from torch import Tensor

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: Union[int, str]) -> int:
    """``5_000_000_000``, ``"5GB"`` or ``"500MiB"`` -> bytes (as transformers' ``max_shard_size``)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", str(size), flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"`max_shard_size` must be a number of bytes or a size such as '5GB' or '500MiB', got {size!r}.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class SafetensorsWriter:
    """``add`` tensors (CPU, contiguous, each its own storage) in order; ``close`` names the files and writes the
    index. ``stem``: ``model`` or ``adapter_model``."""

    def __init__(self, folder: Path, max_shard_size: Union[int, str] = "5GB", stem: str = "model") -> None:
        self.folder, self.limit, self.stem = Path(folder), parse_size(max_shard_size), stem
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_bytes = 0
        self.peak_pending_bytes = 0

    def make_room(self, nbytes: int) -> None:
        """Write the pending tensors out now if ``nbytes`` more would not fit in the file: a caller about to bring
        that much into memory holds the file's tensors or those bytes, not both."""
        if self.pending and self.pending_bytes + nbytes > self.limit:
            self._flush()

    def add(self, name: str, tensor: Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.make_room(size)
        if any(t.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() for t in self.pending.values()):
            tensor = tensor.clone()  # two names of one tensor (a tie): safetensors wants a storage each
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"{self.stem}.part{len(self.files)}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})  # transformers checks "format"
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0
        _return_freed_memory()


    def close(self) -> list[str]:
        """Write what is left; return the files' final names."""
        if self.pending or not self.files:
            self._flush()
        count = len(self.files)
        if count == 1:
            (self.folder / self.files[0][0]).rename(self.folder / f"{self.stem}.safetensors")
            return [f"{self.stem}.safetensors"]
        final = [f"{self.stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for (temporary, names), name in zip(self.files, final):
            (self.folder / temporary).rename(self.folder / name)
            weight_map.update(dict.fromkeys(names, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        return final


def _return_freed_memory() -> None:
    """glibc keeps freed blocks below its (growing) mmap threshold for reuse, so a process that wrote one file's
    tensors would hold that much more for good: hand them back (a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
