"""The gradients autograd leaves on a unit's gathered parameters: taken off as one flat, padded buffer in the
reduction's dtype; and, inside ``no_sync()`` computing in a dtype lower than the reduction's, summed over the
micro-batches in the reduction's dtype, not in the low-precision ``.grad`` (FSDP2 sums them in ``reduce_dtype``, DDP
under bf16-mixed in its fp32 parameters' ``.grad``; summed in bf16 they were 1.2e-4 off on a 5.7e-2 gradient after one
step). Its cost: while accumulating, each unit's unsharded gradient in that dtype (fp32: twice bf16's)."""

from __future__ import annotations

from itertools import accumulate
from typing import Optional

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors


class UnshardedGrads:
    def __init__(self, params: list[nn.Parameter], numels: list[int], padding: int, device: torch.device) -> None:
        self.params = params  # the gathered parameters
        self.numels = numels
        self.padding = padding
        self.device = device
        self._held: Optional[tuple[Tensor, set[int]]] = None  # micro-batches summed so far, and the slots they used

    @property
    def held(self) -> bool:
        """Micro-batches' gradients are held, not yet reduced."""
        return self._held is not None

    def take(self, dtype: torch.dtype) -> tuple[Tensor, list[int], list[Tensor]]:
        """Flatten the gathered parameters' gradients into one padded buffer in ``dtype`` (added to what
        :meth:`hold` summed) and take them off the parameters.

        Also returns the slots that had a gradient: a parameter unused in this backward keeps
        ``.grad = None`` on its shard, so optimizers skip it exactly as they would without sharding; and
        the gradients taken, which the caller keeps alive until the stream that read them has been waited for.
        """
        grads = [param.grad for param in self.params]
        refuse_sparse(grads)
        for param in self.params:
            param.grad = None
        used = [i for i, grad in enumerate(grads) if grad is not None]
        taken = [grads[i] for i in used]
        if self._held is not None:
            (flat, held_used), self._held = self._held, None
            offset = 0
            for numel, grad in zip(self.numels, grads):
                if grad is not None:
                    flat[offset : offset + numel].add_(grad.reshape(-1))  # (in the held dtype, exactly)
                offset += numel
            return flat, sorted(held_used.union(used)), taken
        if len(used) == len(grads):  # the usual case (torch.cat promotes gradients of another dtype, exactly)
            if not self.padding:  # one copy (flattened in C++), then (computing in bf16) one cast
                return _flatten_dense_tensors(grads).to(dtype), used, taken
            pieces = [grad.reshape(-1) for grad in grads]
            pieces.append(torch.zeros(self.padding, dtype=grads[0].dtype, device=self.device))
            return torch.cat(pieces).to(dtype), used, taken
        pieces = [grad.reshape(-1).to(dtype) if grad is not None else torch.zeros(numel, dtype=dtype, device=self.device)
                  for numel, grad in zip(self.numels, grads)]
        if self.padding:
            pieces.append(torch.zeros(self.padding, dtype=dtype, device=self.device))
        return torch.cat(pieces), used, taken

    def hold(self, dtype: torch.dtype) -> None:
        """Inside ``no_sync()``: this micro-batch's gradients added to the sum held in ``dtype``, taken off the
        parameters (their low-precision ``.grad`` is freed as the unit's backward ends)."""
        flat, used, _ = self.take(dtype)
        self._held = (flat, set(used))

    def held_slots(self) -> set[int]:
        """The slots whose micro-batches' gradients are held (summed here, or on the gathered parameters)."""
        if self._held is not None:
            return set(self._held[1])
        return {i for i, param in enumerate(self.params) if param.grad is not None}

    def drop_slots(self, slots: list[int]) -> None:
        """A ``zero_grad`` cleared these slots' micro-batches (engine/runtime/reduce.py): forgotten, as DDP's."""
        if self._held is None:
            for i in slots:
                self.params[i].grad = None
            return
        flat, used = self._held
        starts = list(accumulate(self.numels, initial=0))
        for i in slots:
            flat[starts[i] : starts[i + 1]].zero_()
            used.discard(i)

    def drop(self) -> None:
        """A backward failed: the micro-batches' sums go with it (as their ``.grad`` would)."""
        self._held = None


def refuse_sparse(grads: list[Optional[Tensor]]) -> None:
    """A sparse gradient from a functional call (``F.embedding(..., sparse=True)``; nn.Embedding(sparse=True) is refused
    at setup) fits no flat buffer: stopped here, naming it, not by torch's 'unsupported memory format' or 'reshape is
    not implemented for sparse tensors'. Every rank runs the same model, so every rank stops here."""
    if any(grad is not None and grad.layout != torch.strided for grad in grads):
        raise RuntimeError("lightning_shard: a parameter of a sharded unit received a sparse gradient (a functional"
                           " `F.embedding(..., sparse=True)` / `F.embedding_bag(..., sparse=True)` or a torch.sparse op"
                           " on the parameter), which cannot be sharded or reduce-scattered: call it with sparse=False"
                           " (the default), whose dense gradient any torch.optim optimizer takes.")
