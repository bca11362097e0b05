"""The model's buffers (BatchNorm's running statistics ...) made rank 0's on every rank: before a step that follows a
training step, as DDP's ``broadcast_buffers`` does, and for a checkpoint, which writes one consistent copy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats


class ModuleBuffers:
    def __init__(self, root: nn.Module, group: Optional[dist.ProcessGroup], stats: CommStats, world_size: int,
                 broadcast: bool) -> None:
        self.root = root
        self.group = group  # every rank of the world
        self.stats = stats
        self.world_size = world_size
        self.broadcast = broadcast  # DDP's broadcast_buffers
        self.stale = False  # the ranks' buffers may differ (a training step updated them locally)

    @torch.no_grad()
    def sync(self) -> None:
        """Rank 0's buffers on every rank, one broadcast per dtype: DDP's ``broadcast_buffers``, and one consistent copy
        for a checkpoint. Every rank must call it."""
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
        self.stale = False

    def before_step(self, may_change: bool) -> None:
        """A step every rank runs begins (under ``broadcast_buffers``): rank 0's buffers if the last one may have changed
        them; ``may_change``: this one may (a training step, not inside ``no_sync()``)."""
        if not self.broadcast:
            return
        if self.stale:
            self.sync()
        self.stale = may_change

    def sync_if_stale(self) -> None:
        """Before the units are held gathered for evaluation (keep_gathered()): as the next step's start would."""
        if self.broadcast and self.stale:
            self.sync()
            self.stale = False

    @contextmanager
    def rank0(self, everywhere: bool = True) -> Iterator[None]:
        """Rank 0's buffers in the module tree while the block runs (a checkpoint writes them; DCP from any one rank),
        on every rank (``everywhere``) or on rank 0 alone. Every rank must enter it. With ``broadcast_buffers`` they are
        made rank 0's in place, for good, as DDP's next forward would. Without, each rank's own come back after the
        block: DDP's ``state_dict()`` reads the buffers and changes none, so each rank keeps its running statistics."""
        if self.broadcast or self.world_size == 1:
            self.sync()
            yield
            return
        if not everywhere:  # rank 0's own are rank 0's
            yield
            return
        owners = [(module, name, buffer) for module in self.root.modules()
                  for name, buffer in module._buffers.items() if buffer is not None]
        for module, name, buffer in owners:
            module._buffers[name] = buffer.clone()
        try:
            self.sync()
            yield
        finally:
            for module, name, buffer in owners:
                module._buffers[name] = buffer
