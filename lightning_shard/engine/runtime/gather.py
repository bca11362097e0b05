"""The gather schedule: all-gather a unit's parameters before it runs, prefetch the next ones, free them after.

Prefetch follows the order in which units ran on the previous step (forward, then the same order reversed
for backward): while one unit computes, the all-gathers of the next ``prefetch`` units are in flight, so at
most ``1 + prefetch`` units are gathered at once under ``full`` sharding (plus the root unit).

On a GPU each all-gather, and the cast of the shard it sends, runs on the gather stream (streams.py).
Note: the gathered buffers are allocated and freed on the compute stream, in host order, and every gather
first waits for the compute stream: a buffer freed by the host is reused only in compute order, so device
memory keeps the host's bound even when the host runs far ahead of the device.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats, Pending
from lightning_shard.engine.comm.streams import Streams
from lightning_shard.engine.storage.unit import Unit


class GatherSchedule:
    def __init__(self, group: Optional[dist.ProcessGroup], stats: CommStats, prefetch: int, streams: Streams) -> None:
        self.group = group
        self.stats = stats
        self.streams = streams
        self.prefetch = prefetch
        self.gathered_bytes = 0  # bytes of gathered buffers alive now (root included)
        self.peak_gathered_bytes = 0
        self.trace: Optional[list[tuple[str, str]]] = None  # (collective, unit) in issue order, for tests
        self.order: list[Unit] = []  # forward order of units recorded on the previous step
        self._backward_order: list[Unit] = []  # the same, reversed
        self._current_order: list[Unit] = []
        self._forward_cursor = 0
        self._backward_cursor = 0
        self._warned_order_change = False
        self._nothing_to_prefetch = False  # every unit of the order is its shard, or a cast made when it is gathered
        self._gathered_storage: dict[int, Unit] = {}  # data pointer of a gathered buffer -> its unit (tracked or not)
        self.track_storage = False  # backward elision asks which unit a saved tensor belongs to
        # the units all-gathered since the ranks last compared them, hashed in issue order (take_issued)
        self._issued = 0

    def note(self, op: str, unit: Unit) -> None:
        if self.trace is not None:
            self.trace.append((op, unit.name))

    # -- one unit -----------------------------------------------------------------------------------
    def launch(self, unit: Unit) -> None:
        """Start the unit's all-gather on the gather stream without waiting for it (one rank: cast it on compute).
        Offload's step of the unit, where it is still to come (``finish_in_forward``), is waited for first, a prefetch's
        too: skipped where the host is behind on one rank only, the prefetch would be issued after a collective of the
        computation in hand there (SyncBatchNorm's) and before it elsewhere, a mismatch."""
        if unit.is_gathered or unit.inflight is not None:
            return
        storage, streams = unit.storage, self.streams
        if storage.adopt_rebound_shards():  # (on compute: what a momentum teacher's `p.data = ...` gave them)
            streams.writes(("shard", unit.name))
        unit.launched_version = storage.shard._version
        if storage.aliases_shard:
            return
        self.note("all_gather", unit)
        if not storage.is_allocated:  # a refresh (after an optimizer step) reuses its buffer
            self.gathered_bytes += storage.gathered_nbytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        buffer = storage.allocate()  # on compute: its memory is reused in compute order
        streams.writes(("gathered", unit.name))
        if storage.casts_on_compute:  # done as issued: nothing in flight
            streams.reads(("shard", unit.name))
            storage.fill_gathered(storage.gathered_data)
            streams.writes(("gathered", unit.name))
            return
        # the gather stream must not overwrite what compute still reads, nor send a shard the optimizer is writing
        streams.handover("compute", "gather")
        with streams.on("gather"):
            streams.reads(("shard", unit.name))
            if storage.world_size == 1:  # offloaded: a copy in from the host (and a cast)
                storage.fill_gathered(storage.gathered_data)
                streams.writes(("gathered", unit.name))
                unit.inflight = Pending(None, buffer, self.stats)
            else:
                self._issued = collectives.fingerprint_step(self._issued, unit.index)
                unit.inflight = collectives.all_gather(
                    buffer, storage.shard_for_gather(), self.group, self.stats, async_op=True,
                    label=f"all-gather of unit {unit.name!r}",
                )

    def take_issued(self) -> int:
        """A hash of the units all-gathered since the last call, in issue order, for the ranks to compare: where a
        unit ran on some ranks only (a module called on some ranks' data, in a unit of its own), an all-gather of one
        unit met another's of the same size on another rank, and each rank computed with the other's shards."""
        issued, self._issued = self._issued, 0
        return issued

    def compare_issued(self, group: Optional[dist.ProcessGroup]) -> None:
        """Every rank of ``group``: raise where the ranks all-gathered different units since the last comparison."""
        issued = self.take_issued()
        high, low = collectives.agree(torch.tensor([issued, -issued]), group, self.stats,
                                      label="agreement on the units gathered").tolist()
        if high != -low:
            raise different_gathers()

    def _land(self, unit: Unit) -> None:
        """The unit's all-gather completes on the gather stream, whose work compute then waits for."""
        assert unit.inflight is not None
        if unit.inflight.has_work_left:  # else (a cast at one rank) the gather stream has written it already
            with self.streams.on("gather"):
                unit.inflight.wait()
                self.streams.writes(("gathered", unit.name))
        unit.inflight = None
        self.streams.handover("gather", "compute")

    def gather(self, unit: Unit, exposed: bool = False) -> None:
        """``exposed``: gathered where code other than the unit's backward may write it (a forward, a step's root, an
        evaluation loop): written back to the shard when freed, or before an optimizer step (:meth:`write_back`)."""
        if unit.is_gathered:
            return
        self.launch(unit)
        if unit.inflight is not None:
            self._land(unit)
            storage = unit.storage
            written = storage.adopt_rebound_shards(alike_on_every_rank=True)
            if written or storage.shard._version != unit.launched_version:
                self.streams.writes(("shard", unit.name))
                # its shards were written since the all-gather was issued (a prefetch: a momentum teacher updated in
                # forward before its use): gathered again, on every rank alike (the same code bumped every rank's
                # version counter, or gave every rank's shard parameters tensors)
                self.launch(unit)
                self._land(unit)
        self.streams.reads(("gathered", unit.name))
        unit.storage.use_gathered()
        unit.is_gathered = True
        if exposed:
            unit.writable, unit.gathered_version = True, unit.storage.shard._version
        if self.track_storage and not unit.storage.aliases_shard:
            self._gathered_storage[unit.storage.gathered.untyped_storage().data_ptr()] = unit

    def reshard(self, unit: Unit, keep_storage: bool = False) -> None:
        """The tree holds the unit's shard parameters; its gathered buffer is freed unless ``keep_storage`` (autograd
        may still read it: a graph kept by ``create_graph=True``; a gather writes the same values into it again)."""
        if unit.inflight is not None:  # never free a buffer a collective is still writing
            self._land(unit)
        self.write_back(unit)
        if unit.is_gathered:
            unit.storage.use_shards()
            unit.is_gathered = False
            if self.track_storage:
                self._gathered_storage.pop(unit.storage.gathered.untyped_storage().data_ptr(), None)
        if not unit.storage.aliases_shard and unit.storage.is_allocated and not keep_storage:
            self.gathered_bytes -= unit.storage.gathered_nbytes
            self.streams.writes(("gathered", unit.name))  # freed on compute, after every reader has been waited for
            unit.storage.free()

    def write_back(self, unit: Unit) -> None:
        """What code wrote into the unit's gathered copy since it was gathered, into this rank's shard. Not where the
        shard itself was written in place since (its version counter moved: an optimizer's step that no after-step
        refresh followed): the copy is stale then, and the shard's values win."""
        if not unit.writable:
            return
        unit.writable = False
        storage = unit.storage
        if storage.shard._version != unit.gathered_version:
            return
        self.streams.reads(("gathered", unit.name))
        self.streams.writes(("shard", unit.name))
        with torch._C.DisableTorchFunction():  # the engine's own reads, unseen by elision's watch of the forward's ops
            storage.write_back()

    def refresh(self, units: list[Unit]) -> None:
        """Re-gather the units held gathered, after their shards changed (optimizer step, loading): what was written
        into their copies before is dropped (an optimizer step writes them back first: step_watch.py)."""
        for unit in units:
            if unit.is_gathered and not unit.storage.aliases_shard:
                unit.is_gathered, unit.writable = False, False
                self.gather(unit, exposed=True)
            elif unit.is_gathered and not unit.storage.offloaded:  # its shard: only `p.data = ...` to adopt
                unit.writable, unit.gathered_version = True, unit.storage.shard._version

    def unit_of_storage(self, data_ptr: int) -> Optional[Unit]:
        """The unit whose gathered buffer lives at ``data_ptr``, if any."""
        return self._gathered_storage.get(data_ptr)

    # -- prefetch along the recorded order ----------------------------------------------------------
    def start_forward(self) -> None:
        """A step begins: nothing is prefetched before its first unit runs. The step's own code runs first
        (``training_step`` before its forward), and a write through ``.data`` there (WGAN's weight clipping), which no
        version counter sees, must reach the shards before they are gathered; the first unit's gather is issued when
        it is reached, the CPU still ahead of the device."""
        self._current_order = []
        self._forward_cursor = 0

    def forward_reached(self, unit: Unit) -> None:
        self._current_order.append(unit)
        self._forward_cursor = self._prefetch_after(unit, self.order, self._forward_cursor)

    def start_backward(self) -> None:
        self._backward_cursor = 0

    def backward_reached(self, unit: Unit, needs_gather: Callable[[Unit], bool]) -> None:
        """Prefetch the units whose backward follows ``unit``'s, those of them that need a gather at all."""
        self._backward_cursor = self._prefetch_after(unit, self._backward_order, self._backward_cursor, needs_gather)

    def _prefetch_after(self, unit: Unit, order: list[Unit], cursor: int,
                        needs_gather: Optional[Callable[[Unit], bool]] = None) -> int:
        """Launch the gathers of the ``prefetch`` units that follow ``unit`` in ``order``; returns the new cursor.
        A unit not found (the order changed) prefetches nothing."""
        if not self.prefetch or self._nothing_to_prefetch:
            return cursor
        try:
            position = order.index(unit, cursor)
        except ValueError:
            return cursor
        for upcoming in order[position + 1 : position + 1 + self.prefetch]:
            # a cast on compute is made when the unit is gathered: made ahead, it would be made again
            if not upcoming.storage.casts_on_compute and (needs_gather is None or needs_gather(upcoming)):
                self.launch(upcoming)
        return position + 1

    def record_order(self) -> None:
        """End of a step's forward: the order just seen is the one the next step prefetches along."""
        current, self._current_order = self._current_order, []
        if not current or current == self.order:
            return
        if self.order and not self._warned_order_change:
            self._warned_order_change = True
            warnings.warn(
                "lightning_shard: the order in which units run changed between steps; prefetching follows the"
                " newest order (results are unaffected, only the overlap of communication with compute)."
            )
        self.order, self._backward_order = current, current[::-1]
        self._nothing_to_prefetch = all(u.storage.aliases_shard or u.storage.casts_on_compute for u in current)


def different_gathers() -> RuntimeError:
    return RuntimeError(
        "lightning_shard: the ranks all-gathered different units (in this step, or in forwards outside the steps since"
        " the last), so a rank computed with another unit's shards. A module called on some ranks only (routed"
        " experts held as modules of their own, a branch taken on some ranks' data) is in a unit of its own: keep it"
        " in the unit of the module that calls it, by naming that module's class in `units=` (the MoE block, say),"
        " or with a larger `unit_size`.")
