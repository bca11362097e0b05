"""Storage of a unit whose parameters differ in dtype (issue 48): a bf16 frozen base beside fp32 LoRA adapters and
fp32 norms, packed 4-bit weights and their quantization state. A :class:`FlatShard` whose buffers are *bytes*
(layout: ``mixed_layout.py``), so a unit is still gathered by one collective, and every parameter keeps the dtype
the model gave it: a frozen bf16 base stays bf16 (no fp32 master), packed bytes are never read as numbers.

Rank ``r`` owns bytes ``[r * S, (r + 1) * S)`` of the gathered buffer (``shard_numel`` = S, in bytes). Its master
shard holds that range as it is gathered (the slots gathered as they are stored: a frozen bf16 base, packed bytes),
then each cast slot's part in its master dtype (fp32 adapters gathered in bf16). The first part *is* the gather
input: before a gather, each run of cast slots is cast into its place there (one kernel a run; the fp32 masters
are what the optimizer steps), and nothing else is copied. Master shards are padded to the longest rank's, so that
they too gather in one collective (full state dicts).

Gradients: only the slots that train get them. The reduce-scatter's input holds, for each rank, the parts of the
trainable slots that rank owns, in order, padded to the longest rank's (a unit's LoRA adapters, not its frozen
base): frozen bytes cost nothing in backward. A slot's reduced gradient becomes its shard's ``.grad`` in the slot's
master dtype.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_shard.engine.storage import quantized
from lightning_shard.engine.storage.flat_shard import FlatShard, _refuse_autograd_grads
from lightning_shard.engine.storage.mixed_layout import MixedLayout, MixedSlot, master_layout, part
from lightning_shard.engine.storage.offload import HostShard
from lightning_shard.engine.storage.unsharded_grads import UnshardedGrads


class MixedShard(FlatShard):
    def __init__(self, layout: MixedLayout, flat: Tensor, rank: int, world_size: int,  # type: ignore[override]
                 param_dtype: Optional[torch.dtype] = None) -> None:
        """``flat``: the unit's full buffer in master dtypes, bytes at each slot's ``source`` (mixed_layout.py)."""
        self.slots = slots = layout.slots
        self.rank, self.world_size = rank, world_size
        self.shard_numel = layout.shard_nbytes  # bytes
        self.padded_numel = self.shard_numel * world_size
        self.shard_start = rank * self.shard_numel
        # gradients are reduced (by default) and inputs cast against the widest floating dtype that can train
        trainable = [s.master_dtype for s in slots if not s.packed and s.master_dtype.is_floating_point]
        self.master_dtype = max(trainable, key=lambda d: d.itemsize, default=torch.float32)
        self.param_dtype = param_dtype or self.master_dtype
        self.device = flat.device
        self.device_type = self.device.type
        self.computes_lower = any(s.casts for s in slots)

        # every rank's master layout (full state dicts read them all)
        self._layouts = [master_layout(slots, self.shard_numel, r) for r in range(world_size)]
        self._master_offsets = self._layouts[rank][0]
        self._runs = self._cast_runs()
        shard = self._new_shard(max(size for _, size in self._layouts), torch.uint8)
        for i, slot in enumerate(slots):
            lo, hi = self.param_range(slot, rank)
            if hi > lo:
                source = flat[slot.source : slot.source + slot.master_nbytes].view(slot.master_dtype)
                self._master_view(shard, i, lo, hi).copy_(source[lo:hi])
        self.shard = shard

        self.aliases_shard = world_size == 1 and not self.computes_lower and not self.offloaded
        self.casts_on_compute = world_size == 1 and not self.aliases_shard and not self.offloaded
        self.gathered = self.shard if self.aliases_shard else torch.empty(self.padded_numel, dtype=torch.uint8,
                                                                           device=self.device)
        self.gathered_data = self.gathered.data
        self.gathered_nbytes = self.padded_numel
        self._allocated = True
        self.shard_params = [self._shard_param(i) for i in range(len(slots))]
        self.gathered_params = self._gathered_params()
        self.free()
        self._index_params()
        self.unsharded = MixedUnshardedGrads(self)
        self._shard_grad: Optional[weakref.ref] = None  # no flat gradient shard: each slot's .grad is its own
        self._shard_grad_views: dict[int, weakref.ref] = {}
        self._grad_layout_of: Optional[tuple] = None
        self._reduced_slots = set(self.trainable)  # the slots that have trained: those reduced (see _grad_layout)

    # -- layout -------------------------------------------------------------------------------------
    def param_range(self, slot: MixedSlot, rank: int) -> tuple[int, int]:  # type: ignore[override]
        return part(slot, self.shard_numel, rank)

    def shard_range(self, slot: MixedSlot) -> tuple[int, int]:  # type: ignore[override]
        raise NotImplementedError("a unit of several dtypes has no element offsets into its byte shard: read"
                                  " `shard_params[i]` (this rank's part of slot i) or `param_range(slot, rank)`")

    def _master_view(self, shard: Tensor, i: int, lo: int, hi: int) -> Tensor:
        slot, start = self.slots[i], self._master_offsets[i] if hi > lo else 0
        return shard[start : start + (hi - lo) * slot.master_dtype.itemsize].view(slot.master_dtype)

    def _cast_runs(self) -> list[tuple[int, int, int, torch.dtype, torch.dtype]]:
        """The cast slots' parts on this rank: ``(byte offset in the rank's range, master byte offset, elements,
        master dtype, gather dtype)``, merged where they follow each other in both layouts with one pair of dtypes
        (one cast kernel each)."""
        runs: list[tuple[int, int, int, torch.dtype, torch.dtype]] = []
        for i, slot in enumerate(self.slots):
            lo, hi = self.param_range(slot, self.rank)
            if not slot.casts or hi == lo:
                continue
            run = (slot.offset + lo * slot.gather_dtype.itemsize - self.shard_start, self._master_offsets[i], hi - lo,
                   slot.master_dtype, slot.gather_dtype)
            if runs:
                at, master_at, numel, master, gather = runs[-1]
                if ((master, gather) == run[3:] and at + numel * gather.itemsize == run[0]
                        and master_at + numel * master.itemsize == run[1]):
                    runs[-1] = (at, master_at, numel + run[2], master, gather)
                    continue
            runs.append(run)
        return runs

    # -- parameters -----------------------------------------------------------------------------------
    def _shard_param(self, i: int) -> nn.Parameter:
        slot = self.slots[i]
        lo, hi = self.param_range(slot, self.rank)
        param = nn.Parameter(self._master_view(self.shard, i, lo, hi), requires_grad=slot.requires_grad)
        if slot.requires_grad:
            _refuse_autograd_grads(param, slot)
        return param

    def _gathered_params(self) -> list[nn.Parameter]:
        views = [self.gathered[s.offset : s.offset + s.gather_nbytes].view(s.gather_dtype).view(s.shape).data
                 for s in self.slots]
        by_name = {s.names[0]: view for s, view in zip(self.slots, views)}
        params = []
        for slot, view in zip(self.slots, views):
            if slot.quant is None:
                params.append(nn.Parameter(view, requires_grad=slot.requires_grad))
                continue
            states = {key: by_name[slot.quant.state_name(key)] for key in slot.quant.keys}
            owner = slot.locations[0][0] if slot.locations else None
            weight = quantized.params4bit(view, slot.quant, states, owner, alive=self._gathered_alive)
            for module, _ in slot.locations:
                quantized.adopt(module, weight)
            params.append(weight)
        return params

    def _gathered_alive(self) -> bool:
        return self._allocated

    def master_values(self, gathered_masters: Tensor) -> list[Tensor]:
        """Each slot's full master values (its shape), out of every rank's master shard gathered rank-major."""
        rows = gathered_masters.view(self.world_size, -1)
        values = []
        for i, slot in enumerate(self.slots):
            pieces = []
            for rank in range(self.world_size):
                lo, hi = self.param_range(slot, rank)
                if hi > lo:
                    start = self._layouts[rank][0][i]
                    pieces.append(rows[rank, start : start + (hi - lo) * slot.master_dtype.itemsize])
            flat = torch.cat(pieces) if pieces else rows.new_empty(0)
            values.append(flat.view(slot.master_dtype).view(slot.shape))
        return values

    def sync_requires_grad(self) -> list[nn.Parameter]:
        unfrozen = super().sync_requires_grad()
        if unfrozen:
            self._reduced_slots.update(self.trainable)
        packed = [self.slots[i].names[0] for i in self.trainable if self.slots[i].packed]
        if packed:
            raise RuntimeError(f"lightning_shard: {packed} are packed quantized bytes and were set to require"
                               " gradients: they cannot train. Freeze them again (train adapters beside them).")
        return unfrozen

    # -- gathering ------------------------------------------------------------------------------------
    def shard_for_gather(self) -> Tensor:
        """The rank's range of its own master shard, the cast slots' parts cast into their places there first (bytes
        nothing else reads): no copy of the rest, which a LoRA unit's frozen base is."""
        self._write_casts(self.shard.data)  # (derived bytes: not a write to the shard its version counter should see)
        return self.shard[: self.shard_numel]

    def write_gather_input(self, out: Tensor) -> None:
        out.copy_(self.shard[: self.shard_numel])
        self._write_casts(out)

    def _write_casts(self, out: Tensor) -> None:
        for at, master_at, numel, master, gather in self._runs:
            source = self.shard[master_at : master_at + numel * master.itemsize].view(master)
            out[at : at + numel * gather.itemsize].view(gather).copy_(source)

    # -- gradients ------------------------------------------------------------------------------------
    def _grad_layout(self) -> tuple[tuple[int, ...], list[list[tuple[int, int]]], list[int], int]:
        """The slots whose gradients are reduced, each rank's part of each, each rank's total, and the longest total.
        Those that train and those that trained before and were frozen since: a gradient they got then may still be
        held (summed over micro-batches, or waiting for the all-reduce across replicas), which plain torch keeps and
        steps. The same on every rank (what trains is agreed); fixed while what trains does not change."""
        key = tuple(sorted(self._reduced_slots))
        if self._grad_layout_of is None or self._grad_layout_of[0] != key:
            self._grad_layout_of = (key, *self._layout_of(key))
        return self._grad_layout_of

    def _layout_of(self, slots: tuple[int, ...]) -> tuple[list[list[tuple[int, int]]], list[int], int]:
        parts = [[self.param_range(self.slots[i], r) for i in slots] for r in range(self.world_size)]
        totals = [sum(hi - lo for lo, hi in ranks) for ranks in parts]
        return parts, totals, max(totals, default=0)

    def regrid(self, flat: Tensor, slots: tuple[int, ...]) -> Tensor:
        """``flat``, laid out for ``slots`` (an earlier layout's), in the layout of now: a slot that began to train
        since (unfrozen between micro-batches) holds zeros."""
        now, parts, _, longest = self._grad_layout()
        if slots == now:
            return flat
        old_parts, _, old_longest = self._layout_of(slots)
        out = flat.new_zeros(longest * self.world_size)
        for rank in range(self.world_size):
            held, at = {}, rank * old_longest
            for i, (lo, hi) in zip(slots, old_parts[rank]):
                held[i], at = (at, hi - lo), at + hi - lo
            at = rank * longest
            for i, (lo, hi) in zip(now, parts[rank]):
                if i in held:
                    start, numel = held[i]
                    out[at : at + numel] = flat[start : start + numel]
                at += hi - lo
        return out

    def take_unsharded_grads(self, dtype: torch.dtype) -> tuple[Tensor, list[int], list[Tensor]]:
        grads = [param.grad for param in self.gathered_params]
        for param in self.gathered_params:
            param.grad = None
        used = [i for i, grad in enumerate(grads) if grad is not None]
        reduced, parts, totals, longest = self._grad_layout()
        pieces = []
        for rank in range(self.world_size):
            for i, (lo, hi) in zip(reduced, parts[rank]):
                if hi > lo:
                    grad = grads[i]
                    pieces.append(grad.reshape(-1)[lo:hi] if grad is not None
                                  else torch.zeros(hi - lo, dtype=dtype, device=self.device))
            if longest > totals[rank]:
                pieces.append(torch.zeros(longest - totals[rank], dtype=dtype, device=self.device))
        flat = torch.cat(pieces).to(dtype) if pieces else torch.zeros(0, dtype=dtype, device=self.device)
        return flat, used, [g for g in grads if g is not None]

    def grad_shard_layout(self) -> tuple[int, list[tuple[int, int]]]:
        reduced, parts, _, longest = self._grad_layout()
        ranges, at = [(0, 0)] * len(self.slots), 0
        for i, (lo, hi) in zip(reduced, parts[self.rank]):
            ranges[i] = (at, at + hi - lo)
            at += hi - lo
        return longest, ranges

    def accumulate_shard_grad(self, reduced: Tensor, used: list[int]) -> None:
        _, ranges = self.grad_shard_layout()
        used_here = set(used)
        for i in self._grad_layout()[0]:  # (frozen since it got a gradient or not: plain torch keeps it)
            param = self.shard_params[i]
            if param.grad is None and i not in used_here:
                continue
            lo, hi = ranges[i]
            view = reduced[lo:hi].to(self.slots[i].master_dtype)
            if param.grad is None:
                param.grad = view
            else:
                param.grad.add_(view)
        self._shard_grad, self._shard_grad_views = None, {}

    def hand_over_grads(self, reduce_dtype: torch.dtype) -> None:
        if self.unsharded.held:  # micro-batches summed inside no_sync: with this one's, through the layout
            flat, used, _ = self.unsharded.take(reduce_dtype)
            self.accumulate_shard_grad(flat, used)
            return
        for i, (gathered, shard) in enumerate(zip(self.gathered_params, self.shard_params)):
            grad = gathered.grad
            if grad is None:  # (one frozen since it got its gradient keeps it, as in plain torch)
                continue
            gathered.grad = None
            grad = grad.reshape(-1).to(reduce_dtype).to(self.slots[i].master_dtype)
            if shard.grad is None:
                shard.grad = grad
            else:
                shard.grad.add_(grad)


    def own_gather_ranges(self) -> list[tuple[int, int]]:
        ranges = []
        for slot in self.slots:
            lo = max(slot.offset - self.shard_start, 0)
            hi = min(slot.offset + slot.gather_nbytes - self.shard_start, self.shard_numel)
            ranges.append((lo, hi) if hi > lo else (0, 0))
        return ranges

    # -- writes from outside the optimizer (a constraint, ``p.data = ...``): kept, as flat_shard.py keeps them ---------
    def _gathered_view(self, i: int) -> Tensor:
        slot = self.slots[i]
        return self.gathered_data[slot.offset : slot.offset + slot.gather_nbytes].view(slot.gather_dtype).view(slot.shape)

    def _shard_view(self, i: int) -> Tensor:
        return self._master_view(self.shard, i, *self.param_range(self.slots[i], self.rank))

    def _adopt_replacement(self, i: int, new: Optional[Tensor]) -> None:
        """A packed 4-bit weight's replacement (a re-quantized ``Params4bit``) brings its bytes and its quantization
        state, each into its slot; anything else, its values."""
        slot = self.slots[i]
        if slot.quant is None or new is None:
            return super()._adopt_replacement(i, new)
        spec, values = quantized.replacement(new, slot.quant)
        if spec.dtype != slot.quant.dtype:  # (the same on every rank that ran the same code: held.py checks it)
            self.slots[i] = replace(slot, quant=spec)
            self.gathered_params[i].quant_state.dtype = spec.dtype
        states = {s.names[0]: j for j, s in enumerate(self.slots)}
        for key, value in values.items():
            view = self._gathered_view(i if key is None else states[slot.quant.state_name(key)])
            view.copy_(value.reshape(view.shape))

    def write_back(self) -> None:
        """This rank's part of the gathered bytes into its shard, where code wrote the gathered copy (``p.data.clamp_()``,
        ``p.data = ...``): every rank's copy is the whole parameter and each keeps its own part, as DDP keeps the
        write. The slots gathered as they are stored are those bytes (a copy: the same bytes where nothing wrote); a
        cast slot (an fp32 adapter gathered in bf16) takes the elements that differ from its master's cast, in the
        gathered dtype, and its other elements keep their master's precision. (No collective, no host sync.)"""
        self.adopt_rebound_gathered()
        if self.aliases_shard:  # the gathered buffer is the shard
            return
        local = self.gathered_data[self.shard_start : self.shard_start + self.shard_numel].to(self.shard.device)
        for at, master_at, numel, master, gather in self._runs:
            written = local[at : at + numel * gather.itemsize].view(gather)
            kept = self.shard[master_at : master_at + numel * master.itemsize].view(master)
            torch.where(written != kept.to(gather), written.to(master), kept, out=kept)
        self.shard[: self.shard_numel].copy_(local)  # (the cast slots' bytes there are rewritten before each gather)

    def adopt_rebound_gathered(self) -> None:
        home = self.gathered.untyped_storage().data_ptr()
        if any(p.untyped_storage().data_ptr() != home for p in self.gathered_params):
            self._adopt_rebound(self.gathered_params, self.gathered.untyped_storage(), self._gathered_view)

    def adopt_rebound_shards(self, alike_on_every_rank: bool = False) -> bool:
        """Shard parameters given other tensors (``p.data = t``) hold their values in the shard, viewing it again;
        whether any had one. Each parameter's storage is asked: an empty piece given an empty tensor counts too, so
        every rank that ran the same code answers alike."""
        home = self.shard.untyped_storage().data_ptr()
        if all(p.untyped_storage().data_ptr() == home for p in self.shard_params):
            return False
        self._adopt_rebound(self.shard_params, self.shard.untyped_storage(), self._shard_view)
        self.shards_changed()
        return True


class MixedUnshardedGrads(UnshardedGrads):
    """A unit of several dtypes: its trainable parameters' gradients in its own layout (each rank's part of each,
    rank-major: :meth:`MixedShard.take_unsharded_grads`), summed over micro-batches in the reduction's dtype inside
    ``no_sync`` as :class:`UnshardedGrads` does."""

    def __init__(self, storage: MixedShard) -> None:
        self.storage = storage
        self.params = storage.gathered_params
        self._held = None
        self._held_layout: tuple[int, ...] = ()  # the slots the held sum is laid out for

    def take(self, dtype: torch.dtype) -> tuple[Tensor, list[int], list[Tensor]]:
        flat, used, taken = self.storage.take_unsharded_grads(dtype)
        if self._held is not None:
            (held, held_used), self._held = self._held, None
            held = self.storage.regrid(held, self._held_layout)  # (a slot unfrozen since: one more)
            held.add_(flat)
            return held, sorted(held_used.union(used)), taken
        return flat, used, taken

    def hold(self, dtype: torch.dtype) -> None:
        super().hold(dtype)
        self._held_layout = self.storage._grad_layout()[0]

    def drop_slots(self, slots: list[int]) -> None:
        """The held sum is laid out by rank, each rank's part of each slot: the slots cleared (one optimizer's
        parameters of a unit holding both a GAN's networks) are zeroed in every rank's part."""
        if self._held is None:
            return super().drop_slots(slots)
        flat, used = self._held
        parts, _, longest = self.storage._layout_of(self._held_layout)
        dropped = set(slots)
        for rank, pieces in enumerate(parts):
            at = rank * longest
            for i, (lo, hi) in zip(self._held_layout, pieces):
                if i in dropped:
                    flat[at : at + hi - lo].zero_()
                at += hi - lo
        used.difference_update(dropped)


class HostMixedShard(HostShard, MixedShard):
    """A :class:`MixedShard` offloaded: HostShard's host-side behaviour over MixedShard's byte layout (its staging
    copy is the gather input, which MixedShard writes). Not stepped as its gradients land (host_step.py): its staging
    copy is bytes that the overlapped step's device copy does not make."""

    steps_overlapped = False
