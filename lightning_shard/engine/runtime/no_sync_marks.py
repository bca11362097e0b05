"""What a ``zero_grad`` clears of the micro-batches ``no_sync()`` left unreduced.

DDP's ``no_sync`` leaves each micro-batch's local gradients in ``.grad``, which a ``zero_grad`` clears. Here they are
held elsewhere (the gathered parameters, or one flat sum: unsharded_grads.py), so each slot holding some gets a
``.grad`` "mark" on its shard parameter (a -0.0 tensor where it had none; an existing gradient has its zeros set to
-0.0), for a ``zero_grad`` to clear: set to None, replaced, or zeroed in place (+0.0). A write that keeps the values
(``clip_grad_norm_`` below its norm, ``nan_to_num_``) keeps the sign, and keeps the micro-batches; so does a new
tensor of the same values put in ``.grad`` (``p.grad = torch.nan_to_num(p.grad)``), which is read as the mark after.

A mark is read before each backward and at an optimizer step. Inside ``no_sync()`` the marks found intact stay: a
later backward that does not train a unit (frozen by ``toggle_optimizer``) would otherwise lose its marks, and a
``zero_grad`` after it would go unseen. Outside, they come off (a synced backward's gradients go to ``.grad``).

An empty shard (its rank holds none of a parameter) carries no sign: what a rank read is agreed with the others in
one small all-reduce of a code per slot (zeroed > kept > cannot tell), so that every rank drops the same slots.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats
from lightning_shard.engine.storage.unit import Unit

# what one rank read of a slot's mark, agreed by the maximum over ranks
_UNKNOWN, _KEPT, _ZEROED = 0, 1, 2


class NoSyncMarks:
    def __init__(self, units: list[Unit], agreements, world_size: int, stats: CommStats) -> None:
        self.units = units
        self.agreements = agreements
        self.world_size = world_size
        self.stats = stats
        # id(unit) -> {slot: (its shard parameter's .grad as marked, that tensor's version, whether it was made here)};
        # an entry for every unit trained inside no_sync() since the last sync point: the same keys on every rank
        self._marks: dict[int, dict[int, tuple[Tensor, int, bool]]] = {}

    def mark(self, unit: Unit) -> None:
        """``unit``'s micro-batches are left unreduced: each slot holding some and not marked yet gets its mark."""
        marks = self._marks.setdefault(id(unit), {})
        params, new = unit.storage.shard_params, {}
        for i in unit.storage.unsharded.held_slots() - marks.keys():
            new[i] = params[i].grad is None
            if new[i]:
                params[i].grad = torch.full_like(params[i], -0.0)
            else:
                params[i].grad.masked_fill_(params[i].grad == 0, -0.0)
        # (versions once all are written: the views of one flat gradient share one version counter)
        marks.update({i: (params[i].grad, params[i].grad._version, made) for i, made in new.items()})

    def forget_zeroed(self, keep: bool = False) -> None:
        """Before a backward adds to them, or at an optimizer step: the unreduced micro-batches of each slot whose mark
        a ``zero_grad`` cleared since are dropped, on every rank alike. ``keep`` (a backward inside ``no_sync()``): the
        other marks stay; else the marks made here come off."""
        if not self._marks:  # (every backward and step asks; the same on every rank)
            return
        zeroed = self._agreed_zeroed()
        kept: dict[int, dict[int, tuple[Tensor, int, bool]]] = {}
        for unit in self.units:
            marks = self._marks.get(id(unit))
            if marks is None:
                continue
            params, dropped = unit.storage.shard_params, zeroed.get(id(unit), [])
            # a mark replaced by a tensor of its values (``p.grad = torch.nan_to_num(p.grad)``) is read from there on
            kept[id(unit)] = {i: (now, now._version, made) for i, (mark, _, made) in marks.items()
                              if i not in dropped for now in [_current(params[i].grad, mark)]}
            if not keep:
                for i, (_, _, made) in kept[id(unit)].items():
                    if made:
                        params[i].grad = None
            if dropped:
                unit.storage.unsharded.drop_slots(dropped)
        self._marks = kept if keep else {}

    def _agreed_zeroed(self) -> dict[int, list[int]]:
        """id(unit) -> its slots a zero_grad cleared, as the ranks that can tell read it."""
        read, local = [], []
        units = [unit for unit in self.units if id(unit) in self._marks]  # (the same on every rank)
        for unit in units:
            marks = self._marks[id(unit)]
            for i, param in enumerate(unit.storage.shard_params):
                code, moved = _read(param.grad, marks.get(i))
                read.append(code)
                local.append(moved)
        codes = torch.tensor(read, dtype=torch.uint8)
        if self.world_size > 1:
            collectives.agree(codes, self.agreements, self.stats, label="agreement on the gradients zero_grad cleared")
        zeroed: dict[int, list[int]] = {}
        flat = 0
        for unit in units:
            for i in range(len(unit.storage.shard_params)):
                code = int(codes[flat])
                # no rank can tell (every rank holding it holds an empty shard: routed experts): its own version says
                if code == _ZEROED or (code == _UNKNOWN and local[flat]):
                    zeroed.setdefault(id(unit), []).append(i)
                flat += 1
        return zeroed


def _read(grad: Optional[Tensor], mark: Optional[tuple[Tensor, int, bool]]) -> tuple[int, bool]:
    """What this rank reads of one slot's mark, and whether it was written since (for a slot no rank can tell)."""
    if mark is None:
        return _UNKNOWN, False
    tensor, version = mark[0], mark[1]
    if grad is None:  # set to None
        return _ZEROED, True
    if grad is not tensor:  # replaced: by zeros (a zero_grad by hand) or by the same values (nan_to_num, a clone)
        if not grad.numel():
            return _UNKNOWN, False
        return (_ZEROED, True) if _zeroed(grad) else (_KEPT, True)
    moved = tensor._version != version
    if not tensor.numel():
        return _UNKNOWN, moved
    if moved and _zeroed(tensor):
        return _ZEROED, True
    return _KEPT, moved


def _current(grad: Optional[Tensor], mark: Tensor) -> Tensor:
    """The tensor that holds a kept mark now: the one it was, or the one that replaced it."""
    return mark if grad is None else grad


def _zeroed(mark: Tensor) -> bool:
    """A mark written since (rare: one wait for the device) holds +0.0 everywhere only where a ``zero_grad`` zeroed it
    (its zeros were -0.0)."""
    return not bool(torch.logical_or(mark != 0, torch.signbit(mark)).any())
