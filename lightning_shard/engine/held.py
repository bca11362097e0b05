"""What the runtime holds alike on every rank between steps: the buffers, made rank 0's (DDP's
``broadcast_buffers``); the shards, holding what was given to their parameters; and, for evaluation and generation,
every unit gathered: one all-gather per unit for a whole loop and no collective inside it, so ranks may run different
numbers of forwards (generate to different lengths)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_shard.engine import collectives
from lightning_shard.engine.unit import Unit


class HeldUnits:
    """Mixed into ShardRuntime (``units``, ``schedule``, ``root_unit``, the step state it reads)."""

    units: list[Unit]

    def adopt_rebound_shards(self) -> None:
        """Shard parameters given other tensors between steps (``p.data = ...``: a momentum teacher's update) hold
        their values in the shards again: before anything reads the shards (a gather does it itself; a checkpoint)."""
        for unit in self.units:
            unit.storage.adopt_rebound_shards()

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm running statistics ...) on every rank, one broadcast per dtype: DDP's
        ``broadcast_buffers``, and one consistent copy for a checkpoint. Every rank must call it."""
        if self.world_size == 1:
            return
        by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for buffer in self.root.buffers():
            by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        for (dtype, _), buffers in by_kind.items():
            flat = collectives.broadcast(torch.cat([b.reshape(-1) for b in buffers]), self.group, self.stats,
                                         label=f"broadcast of the {dtype} buffers")
            for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers])):
                buffer.copy_(value.view_as(buffer))
        self._buffers_stale = False

    @contextmanager
    def keep_gathered(self) -> Iterator[None]:
        """Hold every unit gathered for a whole evaluation or generation loop. Every rank must enter (one
        all-gather per unit); inside, forwards run no collective at all, so ranks may run different numbers of
        them (generate to different lengths) without waiting for one another. Forwards without gradients only.
        It costs :meth:`held_bytes` for as long as it lasts: the whole model's parameters in the gather dtype."""
        if self._held:  # nested: the outer one holds them
            yield
            return
        if self._depth or self._final_callback_queued:
            raise RuntimeError("lightning_shard: keep_gathered() entered inside a step or a backward; enter it"
                               " between steps, on every rank.")
        if self.broadcast_buffers and self._buffers_stale:
            self.sync_buffers()
            self._buffers_stale = False
        for unit in self.units:
            self.schedule.gather(unit, exposed=True)
        self._held = True
        try:
            yield
        finally:
            self._held = False
            for unit in self.units:
                self.schedule.reshard(unit)

    def held_bytes(self) -> int:
        """Bytes per rank that :meth:`keep_gathered` adds while it holds every unit (the root is gathered in
        every step anyway, and a unit that is its own shard needs no gathered copy)."""
        return sum(u.storage.gathered_nbytes for u in self.units if not u.storage.aliases_shard and u is not self.root_unit)
