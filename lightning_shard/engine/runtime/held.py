"""Every unit held gathered between steps, for evaluation and generation: one all-gather per unit for a whole loop and
no collective inside it, so ranks may run different numbers of forwards (generate to different lengths). The step's
state (step_state.py) is held meanwhile: forwards inside gather nothing and free nothing.

A write to the held parameters (``with torch.no_grad(): model.fc.weight.mul_(2)``) lands in the gathered buffers,
which are freed on exit: it is kept with ``modifier_rank`` (DeepSpeed's ``GatheredParameters(modifier_rank=)``: that
rank's values written back into every rank's shards), and otherwise refused on exit, naming the parameters, rather
than lost. A write is seen by the version counters of the gathered parameters (any in-place op on them or their views,
on any rank) and by each rank comparing its own part of the buffers with its shard, bit for bit (a write through
``.data``, which no counter sees, on the rank that owns the element: code every rank runs). (So these gathers are not
written back when freed, as a step's are: gather.py.)"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats
from lightning_shard.engine.runtime.buffers import ModuleBuffers
from lightning_shard.engine.runtime.gather import GatherSchedule
from lightning_shard.engine.runtime.step_state import StepState
from lightning_shard.engine.storage.mixed_shard import MixedShard
from lightning_shard.engine.storage.unit import Unit

_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class HeldUnits:
    """Every unit held gathered for evaluation and generation (``keep_gathered``), and what writes inside become."""

    def __init__(self, state: StepState, units: list[Unit], root_unit: Optional[Unit], schedule: GatherSchedule,
                 buffers: ModuleBuffers, group: Optional[dist.ProcessGroup], stats: CommStats,
                 world_size: int) -> None:
        self.state = state  # (held and released here)
        self.units = units
        self.root_unit = root_unit
        self.schedule = schedule
        self.buffers = buffers
        self.group = group  # every rank of the world: writes are agreed, or broadcast from the modifier
        self.stats = stats
        self.world_size = world_size
        self._modifier_rank: Optional[int] = None  # the outermost keep_gathered()'s, while it holds

    @contextmanager
    def keep_gathered(self, modifier_rank: Optional[int] = None, units: Optional[list[Unit]] = None) -> Iterator[None]:
        """Hold every unit gathered for a whole evaluation or generation loop. Every rank must enter (one
        all-gather per unit); inside, forwards run no collective at all, so ranks may run different numbers of
        them (generate to different lengths) without waiting for one another. Forwards without gradients only; the
        backward of a graph made before it may run inside (reduced as usual; the units stay held).
        It costs :meth:`held_bytes` for as long as it lasts: the whole model's parameters in the gather dtype.

        Writes to the parameters inside (in place, ``p.data = t``, or another Parameter object of the same shape and
        dtype in a parameter's place: peft's ``merge_adapter()``) are kept with ``modifier_rank`` (a rank of the runtime's group): that rank's
        values are written back into the shards on exit (one broadcast per unit), on every rank; computing in a
        lower dtype, only the elements it wrote change their masters. Without it a write is an error on exit, on
        every rank, naming the parameters (their version counters, and each rank's part of the buffers compared with
        its shard; one tiny all-reduce). Leaving by an exception runs no collective: writes are then lost. ``units``:
        only these (the same on every rank), one at a time for work that reads a unit's whole parameters (DoRA's
        magnitudes from the loaded base)."""
        if modifier_rank is not None and (not isinstance(modifier_rank, int) or isinstance(modifier_rank, bool)
                                          or not 0 <= modifier_rank < self.world_size):
            raise ValueError(f"lightning_shard: keep_gathered(modifier_rank=...) takes a rank of the runtime's group,"
                             f" 0 to {self.world_size - 1} (or None: writes refused); got {modifier_rank!r}.")
        if self.state.held:  # nested: the outer one holds them, and decides what becomes of writes
            if modifier_rank is not None and modifier_rank != self._modifier_rank:
                raise ValueError("lightning_shard: a keep_gathered(modifier_rank=...) nested in another that does not"
                                 " give the same modifier_rank: give it to the outermost one, which writes back.")
            yield
            return
        if self.state.depth or self.state.backward_running:
            raise RuntimeError("lightning_shard: keep_gathered() entered inside a step or a backward; enter it"
                               " between steps, on every rank.")
        self.buffers.sync_if_stale()
        held = self.units if units is None else list(units)
        for unit in held:
            self.schedule.gather(unit)
        self.state.hold()
        self._modifier_rank = modifier_rank
        versions = _versions(held)
        try:
            yield
            replaced = self._adopt_replaced(held)
            if modifier_rank is None:
                self._refuse_writes(held, versions, replaced)
            else:
                self._write_back(held, modifier_rank)
        finally:
            self.state.release()
            for unit in held:
                self.schedule.reshard(unit)

    @torch.no_grad()
    def _adopt_replaced(self, held: list[Unit]) -> set[str]:
        """What code gave the held parameters in other tensors (``p.data = t``) or other Parameter objects
        (``module.weight = nn.Parameter(t)``, peft's merge on a 4-bit base) is in the gathered buffers, as a write in
        place would be: before they are compared, or the modifier's broadcast; the names of those replaced."""
        replaced: set[str] = set()
        for unit in held:
            replaced.update(unit.storage.adopt_replaced_gathered())
            unit.storage.adopt_rebound_gathered()
        # a 4-bit weight replaced by one dequantizing to another dtype (peft's merge) changes how the unit computes:
        # the same on every rank, or an error on every rank
        dtypes = [zlib.crc32(str(slot.quant.dtype).encode()) for unit in held for slot in unit.storage.slots
                  if getattr(slot, "quant", None) is not None]
        if dtypes and self.world_size > 1:
            mine = collectives.fingerprint(dtypes)
            high, low = collectives.agree(torch.tensor([mine, -mine]), self.group, self.stats,
                                          label="agreement on the 4-bit weights' dtypes").tolist()
            if high != -low:
                raise RuntimeError(
                    "lightning_shard: 4-bit weights were replaced inside keep_gathered() on some ranks only by weights"
                    " that dequantize to another dtype (peft's merge_adapter() does so): run the same code on every"
                    " rank inside keep_gathered().")
        return replaced

    @torch.no_grad()
    def _refuse_writes(self, held: list[Unit], versions: list[list[int]], replaced: set[str]) -> None:
        written = [int(flag or slot.names[0] in replaced) for unit, before in zip(held, versions)
                   for flag, slot in zip(_slots_written(unit, before), unit.storage.slots)]
        if self.world_size > 1 and written:
            written = collectives.agree(torch.tensor(written, dtype=torch.int64), self.group, self.stats,
                                        label="agreement on the parameters written in keep_gathered()").tolist()
        names = [slot.names[0] for unit in held for slot in unit.storage.slots]
        written_names = [name for name, flag in zip(names, written) if flag]
        if written_names:
            raise RuntimeError(
                f"lightning_shard: {written_names[:4]} were written inside keep_gathered() (in place, through `.data`, or"
                " by another Parameter object put in their place), in the gathered copies it frees on exit, so the"
                " write would be lost. Pass keep_gathered(modifier_rank=0) to write that rank's"
                " values back into every rank's shards (as DeepSpeed's GatheredParameters(modifier_rank=0)), or write"
                " between steps through the optimizer's parameters.")

    @torch.no_grad()
    def _write_back(self, held: list[Unit], modifier_rank: int) -> None:
        for unit in held:
            storage = unit.storage
            if self.world_size > 1:  # the modifier's whole buffer to every rank of every replica
                collectives.broadcast(storage.gathered_data, self.group, self.stats, src=modifier_rank,
                                      label=f"broadcast of unit {unit.name!r}'s values written in keep_gathered()")
            if storage.aliases_shard:  # the buffer is the shard: written already
                continue
            own, changed = _own_part_changed(unit)
            if not bool(changed.any()):
                continue
            if isinstance(storage, MixedShard):  # bytes of several dtypes: its own layout's write-back
                storage.write_back()
            else:
                master = storage.shard
                master.copy_(torch.where(changed.to(master.device), own.to(master.device, master.dtype), master))
            storage.shards_changed()

    def held_bytes(self) -> int:
        """Bytes per rank that :meth:`keep_gathered` adds while it holds every unit (the root is gathered in
        every step anyway, and a unit that is its own shard needs no gathered copy)."""
        return sum(u.storage.gathered_nbytes for u in self.units if not u.storage.aliases_shard and u is not self.root_unit)


def _versions(units: list[Unit]) -> list[list[int]]:
    """Per unit, the version counters of its gathered parameters, slot by slot."""
    return [[param._version for param in unit.storage.gathered_params] for unit in units]


def _own_part_changed(unit: Unit) -> tuple[Tensor, Tensor]:
    """This rank's part of the unit's gathered buffer, and which of its elements differ (bit for bit) from its shard
    in the compute dtype, the values the buffer was gathered from."""
    storage = unit.storage
    own = storage.gathered_data[storage.shard_start: storage.shard_start + storage.shard_numel]
    before = storage.shard_for_gather()
    bits = _SAME_SIZE_INTS[own.element_size()]
    return own, own.view(bits) != before.view(bits)


def _slots_written(unit: Unit, versions: list[int]) -> list[bool]:
    """Per slot of the unit, whether it was written since it was gathered (``versions``: its gathered parameters'
    counters then): by an op the counter sees, or in this rank's part of it."""
    if unit.storage.aliases_shard:  # the buffer is the shard: a write is in place, as without sharding
        return [False] * len(unit.storage.slots)
    _, changed = _own_part_changed(unit)
    return [param._version != before or bool(changed[lo:hi].any())
            for param, before, (lo, hi) in zip(unit.storage.gathered_params, versions,
                                               unit.storage.own_gather_ranges())]
