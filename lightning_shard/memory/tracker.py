"""Tensor-level memory accounting on any device (CPU and meta included): the bytes held by live tensor
storages, sampled after every operator, and their peak.

Used to measure what the estimator predicts (``lightning_shard.memory.estimate``) where there is no CUDA
allocator to ask. Storages created before tracking starts are counted once passed to :meth:`track`
(parameters, gradients, optimizer state); a storage counts from the operator that created it until it
is freed, and a storage resized in place (a unit's gathered buffer) counts at its current size.

Note: allocations made by other threads (a collective backend's internals) are not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live: ...``; then ``live.peak`` (bytes) and ``live.current()``."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}
        self.peak = 0

    def track(self, tensors: Iterable[Any]) -> None:
        """Count tensors that existed before tracking began (anything not a tensor is ignored)."""
        for tensor in tensors:
            if isinstance(tensor, Tensor):
                self._add(tensor)
        self._sample()

    def current(self) -> int:
        storages = [ref() for ref in self._storages.values()]
        return sum(storage.nbytes() for storage in storages if storage is not None)

    def reset_peak(self) -> None:
        self.peak = self.current()

    def _add(self, tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._storages:
            self._storages[key] = weakref.ref(storage, lambda _, key=key: self._storages.pop(key, None))

    def _sample(self) -> None:
        self.peak = max(self.peak, self.current())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, Tensor) and not _is_sparse(tensor):
                self._add(tensor)
        self._sample()
        return out


def _is_sparse(tensor: Tensor) -> bool:
    return tensor.layout != torch.strided
