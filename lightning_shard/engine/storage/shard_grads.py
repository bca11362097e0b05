"""A unit's gradient shard on its shard parameters (mixed into FlatShard, flat_shard.py): each slot's ``.grad`` views
one flat, reduced shard, so accumulating a reduction is one add; handed over as they are at one rank; read whole for
the finiteness check and the replicas' deferred all-reduce."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_shard.engine.storage.slots import ParamSlot
from lightning_shard.engine.storage.unsharded_grads import UnshardedGrads, refuse_sparse


class ShardGrads:
    """Mixed into FlatShard: its slots, shard and gathered parameters, dtypes and shard layout."""

    slots: list[ParamSlot]
    shard: Tensor
    shard_params: list[nn.Parameter]
    gathered_params: list[nn.Parameter]
    trainable: list[int]
    unsharded: UnshardedGrads
    param_dtype: torch.dtype
    master_dtype: torch.dtype
    shard_numel: int
    shard_ranges: list[tuple[int, int]]
    _grad_split: list[int]
    _shard_grad: Optional[weakref.ref]
    _shard_grad_views: dict[int, weakref.ref]

    def hand_over_grads(self, reduce_dtype: torch.dtype) -> None:
        """One rank and nothing to reduce: the numbers of ``UnshardedGrads.take`` then
        :meth:`accumulate_shard_grad` (a parameter frozen since it got its gradient keeps it, as in plain torch).
        Computing in the master dtype, without their flat buffer: each gathered parameter's gradient becomes its shard
        parameter's, flattened (no copy), or is added to the one it has."""
        if not (reduce_dtype == self.param_dtype == self.master_dtype):  # a cast per unit, not one per parameter
            flat, used, _ = self.unsharded.take(reduce_dtype)
            self.accumulate_shard_grad(flat, used)
            return
        refuse_sparse([p.grad for p in self.gathered_params])
        for gathered, shard in zip(self.gathered_params, self.shard_params):
            grad = gathered.grad
            if grad is None:
                continue
            gathered.grad = None
            grad = grad.reshape(-1)
            if shard.grad is None:
                shard.grad = grad
            else:
                shard.grad.add_(grad)

    @property
    def shard_grad(self) -> Optional[Tensor]:
        """This rank's flat gradient shard, while some shard parameter's ``.grad`` still views it."""
        return self._shard_grad() if self._shard_grad is not None else None

    def grads_finite(self) -> Tensor:
        """Whether this rank's gradient shard is finite: a 0-dim flag on its device (no host sync here)."""
        shard_grad = self.shard_grad
        if shard_grad is not None:  # one kernel over the flat gradient shard
            return torch.isfinite(shard_grad).all()  # where the shard lives: the caller moves the flags at once
        grads = [p.grad for p in self.shard_params if p.grad is not None]  # handed over one by one (one rank)
        if not grads:
            return torch.ones((), dtype=torch.bool, device=self.shard.device)
        return torch.stack([torch.isfinite(g).all() for g in grads]).all()

    def clear_grads(self) -> None:
        for param in self.shard_params:
            param.grad = None
        self._shard_grad, self._shard_grad_views = None, {}

    def scale_grads(self, factor: float) -> None:
        for i in self.trainable:
            grad = self.shard_params[i].grad
            if grad is not None:
                grad.mul_(factor)

    def take_shard_grads(self, slots: set[int]) -> Optional[tuple[Tensor, list[int]]]:
        """The ``.grad`` of ``slots`` as one flat shard (zeros elsewhere) and the slots that had one, taken off the
        shard parameters; ``None`` if none had one. ``slots`` hold sums not yet all-reduced across replicas (frozen
        since or not: all-reduced all the same, as plain torch keeps a frozen parameter's gradient)."""
        held = [i for i in sorted(slots) if self.shard_params[i].grad is not None]
        if not held:
            return None
        numel, ranges = self.grad_shard_layout()
        flat = self.shard.new_zeros(numel, dtype=self.shard_params[held[0]].grad.dtype)
        for i in held:
            lo, hi = ranges[i]
            flat[lo:hi] = self.shard_params[i].grad
            self.shard_params[i].grad = None
        return flat, held

    def grad_shard_layout(self) -> tuple[int, list[tuple[int, int]]]:
        """The length of this rank's reduced gradient shard, and each slot's part of it."""
        return self.shard_numel, self.shard_ranges

    def accumulate_shard_grad(self, reduced: Tensor, used: list[int]) -> None:
        """Add this rank's reduced gradient shard to the shard parameters' ``.grad``.

        Each ``.grad`` is a view of one flat ``shard_grad``, so accumulating is one add, unless the
        optimizer replaced or cleared some ``.grad`` (``zero_grad(set_to_none=True)``) or a parameter
        gets its first gradient; then a fresh buffer starts, keeping every surviving gradient.
        """
        if reduced.dtype != self.master_dtype:
            reduced = reduced.to(self.master_dtype)
        views = self._shard_grad_views
        shard_grad = self.shard_grad
        if (
            shard_grad is not None
            and all(i in views for i in used)
            and all(_alive_and_is(self.shard_params[i].grad, v) for i, v in views.items())
        ):
            shard_grad.add_(reduced)
            return
        new_views = {}
        # one split() for the views, unless autograd records them (create_graph=True): split()'s views then refuse
        # the in-place add below
        split = None if reduced.requires_grad else reduced.split_with_sizes(self._grad_split)
        used_here = set(used)
        # every slot holding a gradient, trainable or not: one frozen since it got one keeps it, as in plain torch
        for i, param in enumerate(self.shard_params):
            grad = param.grad
            if grad is None and i not in used_here:
                continue
            if split is not None:
                view = split[i]
            else:
                lo, hi = self.shard_ranges[i]
                view = reduced[lo:hi]
            if grad is not None:
                view.add_(grad)
            param.grad = view
            new_views[i] = weakref.ref(view)
        self._shard_grad, self._shard_grad_views = weakref.ref(reduced), new_views


def _alive_and_is(grad: Optional[Tensor], view: weakref.ref) -> bool:
    """``grad`` is still the view it was given (not replaced, and not cleared while another view lives on)."""
    return grad is not None and grad is view()
