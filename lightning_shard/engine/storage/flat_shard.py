"""Storage of one unit: a flat, padded buffer of its parameters, of which this rank owns one shard.

Layout: the unit's parameters are flattened and concatenated in a fixed order, then padded so the total
is a multiple of the world size; rank ``r`` owns elements ``[r * S, (r + 1) * S)`` of that buffer.

Each original parameter appears twice:

* a **shard parameter**: a 1-D ``nn.Parameter`` viewing the part of this rank's shard that holds it
  (possibly empty). It is what the optimizer, ``named_parameters()`` and checkpoints see between steps.
* a **gathered parameter**: an ``nn.Parameter`` of the original shape viewing the gathered buffer. It
  is what the module computes with, and where autograd accumulates the unsharded gradient.

Note: the gathered buffer is freed by resizing its storage to zero, never by dropping the tensor, so
the gathered parameters (and anything autograd saved of them) stay valid after a re-gather.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_shard.engine.storage.outside import GatheredParameters, ShardParameters
from lightning_shard.engine.storage.slots import ParamSlot, _refuse_autograd_grads
from lightning_shard.engine.storage.shard_grads import ShardGrads
from lightning_shard.engine.storage.unsharded_grads import UnshardedGrads


class FlatShard(ShardGrads):
    offloaded = False  # the master shard in host memory, stepped there (engine/storage/offload.py)
    shard_parameter: type = nn.Parameter  # the class of the shard parameters

    def __init__(
        self,
        slots: list[ParamSlot],
        flat: Tensor,
        rank: int,
        world_size: int,
        param_dtype: Optional[torch.dtype] = None,
    ) -> None:
        """``flat`` is the full unsharded, unpadded buffer (identical on every rank); it is not kept."""
        self.slots = slots
        self.rank, self.world_size = rank, world_size
        total = flat.numel()
        self.shard_numel = -(-total // world_size) if total else 0
        self.padded_numel = self.shard_numel * world_size
        self.shard_start = rank * self.shard_numel
        self.master_dtype = flat.dtype
        self.param_dtype = param_dtype or flat.dtype
        self.device = flat.device  # where the unit computes and communicates (the shard may live elsewhere)
        self.device_type = self.device.type
        self.computes_lower = self.param_dtype != self.master_dtype  # (read at every forward: a flag)

        # this rank's master shard, in its own storage (the full buffer is not kept)
        shard = self._new_shard(self.shard_numel, flat.dtype)
        lo, hi = self.shard_start, min(self.shard_start + self.shard_numel, total)
        if hi > lo:
            shard[: hi - lo].copy_(flat[lo:hi])
        self.shard = shard

        # With one shard and no cast the gathered buffer *is* the shard: nothing to gather or free.
        self.aliases_shard = world_size == 1 and self.param_dtype == self.master_dtype and not self.offloaded
        # One shard on the device, computing in another dtype: the gathered copy is a cast, made on the compute stream
        # where it is read (a side stream has nothing to overlap it with, and costs two hand-overs per gather)
        self.casts_on_compute = world_size == 1 and not self.aliases_shard and not self.offloaded
        if self.aliases_shard:
            self.gathered = self.shard
        else:
            self.gathered = torch.empty(self.padded_numel, dtype=self.param_dtype, device=flat.device)
        # the gathered buffer under its own autograd version counter: what the engine writes into it (as an all-gather
        # does) leaves the version of the gathered parameters, which autograd may have saved, as it was
        self.gathered_data = self.gathered.data
        self.gathered_nbytes = self.padded_numel * self.gathered.element_size()

        self._allocated = True  # the gathered buffer has its storage (a flag: asking the storage costs more)
        self.shard_ranges = [self.shard_range(s) for s in slots]  # read at every step's gradient hand-over
        # the slots' parts of the local shard are consecutive from its start (padding last): split() sizes
        self._grad_split = [hi - lo for lo, hi in self.shard_ranges]
        self._grad_split.append(self.shard_numel - sum(self._grad_split))
        self._padding = self.padded_numel - sum(s.numel for s in slots)
        self.shard_params = [self._make_shard_param(s) for s in slots]
        # where each parameter lies, to see one given another tensor (``p.data = ...``): the shard's never moves; in the
        # gathered buffer, the byte offset (-1: none, an empty parameter)
        self._shard_ptrs = [p.data_ptr() for p in self.shard_params]
        self._gathered_at = [s.offset * self.gathered.element_size() if s.numel else -1 for s in slots]
        # each under its own version counter too (``.data``), as separate parameters are: an in-place write to one (the
        # ``set_`` of torch's parametrize, which peft's LoRA on a parameter registers at every forward) leaves the
        # others, which autograd may have saved, valid
        self.gathered_params = [
            nn.Parameter(self.gathered[s.offset : s.offset + s.numel].view(s.shape).data, requires_grad=s.requires_grad)
            for s in slots
        ]
        self.free()  # views exist now; the storage comes back at the first gather
        self._index_params()
        # their gradients, taken off for the reduction (held in the reduction's dtype inside no_sync)
        self.unsharded = UnshardedGrads(self.gathered_params, [s.numel for s in slots], self._padding, self.device)
        # the flat gradient shard and the shard parameters' ``.grad`` views of it, held weakly: the parameters'
        # ``.grad`` keep it alive, so ``zero_grad(set_to_none=True)`` frees it as it does without sharding
        self._shard_grad: Optional[weakref.ref] = None
        self._shard_grad_views: dict[int, weakref.ref] = {}

    def _index_params(self) -> None:
        """Where each parameter is registered in the module tree, per module: swapped at every gather and free of a
        step, one dict.update() per module; and which ones train."""
        slots = self.slots
        in_tree: dict[int, tuple[dict, dict, dict]] = {}  # id(module._parameters) -> (it, shard, gathered params)
        for i, slot in enumerate(slots):
            for module, attr in slot.locations:
                _, shards, gathered = in_tree.setdefault(id(module._parameters), (module._parameters, {}, {}))
                shards[attr], gathered[attr] = self.shard_params[i], self.gathered_params[i]
        self._shards_in_tree = [(parameters, shards) for parameters, shards, _ in in_tree.values()]
        self._gathered_in_tree = [(parameters, gathered) for parameters, _, gathered in in_tree.values()]
        self.trees = [parameters for parameters, _, _ in in_tree.values()]
        # the dicts holding this unit's parameters only, whose class follows its state (engine/storage/outside.py)
        self.sole_trees: list[dict] = []
        self.gathered_ids = frozenset(map(id, self.gathered_params))
        self.trainable = [i for i, s in enumerate(slots) if s.requires_grad]
        self.requires_grad = [s.requires_grad for s in slots]  # as last synced (see sync_requires_grad)
        self._both_params = self.shard_params + self.gathered_params  # compared in one pass at every use of the unit
        self._both_requires_grad = self.requires_grad * 2

    # -- layout -------------------------------------------------------------------------------------
    def param_range(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """The part of ``slot`` held by ``rank``, as offsets into the flattened parameter (may be empty)."""
        start = rank * self.shard_numel
        lo = min(max(slot.offset, start), slot.offset + slot.numel)
        hi = max(lo, min(slot.offset + slot.numel, start + self.shard_numel))
        return lo - slot.offset, hi - slot.offset

    def shard_range(self, slot: ParamSlot) -> tuple[int, int]:
        """The part of ``slot`` held by this rank, as offsets into the local shard (may be empty)."""
        lo, hi = self.param_range(slot, self.rank)
        return lo + slot.offset - self.shard_start, hi + slot.offset - self.shard_start

    def _make_shard_param(self, slot: ParamSlot) -> nn.Parameter:
        lo, hi = self.shard_range(slot)
        param = self.shard_parameter(self.shard[lo:hi], requires_grad=slot.requires_grad)
        if slot.requires_grad:
            _refuse_autograd_grads(param, slot)
        return param

    def own_gather_ranges(self) -> list[tuple[int, int]]:
        """Each slot's part of this rank's piece of the gathered buffer (its offsets there, in the buffer's
        elements; may be empty)."""
        return self.shard_ranges

    def master_values(self, gathered_masters: Tensor) -> list[Tensor]:
        """Each slot's full master values (its shape), out of every rank's master shard gathered rank-major."""
        return [gathered_masters[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    # -- gathered buffer ----------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self._allocated

    def allocate(self) -> Tensor:
        """Give the gathered buffer its storage back; returns the buffer to gather into."""
        if not self._allocated:
            self.gathered.untyped_storage().resize_(self.gathered_nbytes)
            self._allocated = True
        return self.gathered

    def free(self) -> None:
        if not self.aliases_shard:
            self.gathered.untyped_storage().resize_(0)
            self._allocated = False

    def _new_shard(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def shard_for_gather(self) -> Tensor:
        """This rank's contribution to the all-gather, in the compute dtype, on the compute device."""
        return self.shard.to(self.param_dtype)

    def fill_gathered(self, buffer: Tensor) -> None:
        """One rank: the gathered buffer is this rank's shard in the compute dtype (``buffer``: :attr:`gathered_data`)."""
        self.write_gather_input(buffer)

    def write_gather_input(self, out: Tensor) -> None:
        """Write this rank's contribution to the all-gather into ``out`` (one shard of the gathered buffer's dtype)."""
        out.copy_(self.shard)

    def write_back(self) -> None:
        """This rank's part of the gathered buffer into its shard, where something wrote it since the gather (a weight
        constraint, ``p.data.clamp_()``, or ``p.data = ...``, on the parameters the module holds): every rank's copy
        is the whole parameter, each keeps its own part, so the write is kept as it is under DDP. Computing in the
        master dtype it is a copy (the same values where nothing wrote); in a lower one only the elements that differ
        from the shard's cast are taken, in that dtype (the masters elsewhere keep their precision). (No autograd:
        the shard and the gathered buffer's ``.data`` record none, and ``no_grad`` costs more than the rest.)"""
        self.adopt_rebound_gathered()
        if self.aliases_shard:  # the gathered buffer is the shard
            return
        # (offloaded: brought to the host, where the master is; HostShard does so only where code wrote it)
        local = self.gathered_data[self.shard_start : self.shard_start + self.shard_numel].to(self.shard.device)
        if not self.computes_lower:
            self.shard.copy_(local)
            return
        written = local != self.shard.to(self.param_dtype)
        torch.where(written, local.to(self.master_dtype), self.shard, out=self.shard)

    def adopt_rebound_gathered(self) -> None:
        """Gathered parameters given other tensors (``p.data = t``) hold their values in the gathered buffer again."""
        base = self.gathered_data.data_ptr()
        if [p.data_ptr() for p in self.gathered_params] != [base + at if at >= 0 else 0 for at in self._gathered_at]:
            self._adopt_rebound(self.gathered_params, self.gathered.untyped_storage(), self._gathered_view)

    def adopt_rebound_shards(self, alike_on_every_rank: bool = False) -> bool:
        """Shard parameters given other tensors (``p.data = t``: MoCo and BYOL update a momentum teacher so) hold their
        new values in the shard, which a gather reads, and view it again; whether any had one. ``alike_on_every_rank``:
        also an empty piece given an empty tensor counts (its address is none), so that every rank that ran the same
        code gives the same answer (slower: each parameter's storage is asked)."""
        storage = self.shard.untyped_storage()
        if alike_on_every_rank:
            home = storage.data_ptr()
            if all(p.untyped_storage().data_ptr() == home for p in self.shard_params):
                return False
        elif [p.data_ptr() for p in self.shard_params] == self._shard_ptrs:  # the usual case, at every gather
            return False
        self._adopt_rebound(self.shard_params, storage, self._shard_view)
        self.shards_changed()
        return True

    def adopt_replaced_gathered(self) -> list[str]:
        """Parameter objects put in the tree in place of gathered ones (``module.weight = nn.Parameter(...)``; peft's
        ``merge_adapter()`` on a 4-bit base installs a re-quantized weight): their values copied into the gathered
        buffer, which is what sharding keeps, and the gathered parameters registered again. Returns their names."""
        replaced = []
        for parameters, gathered in self._gathered_in_tree:
            for attr, param in gathered.items():
                new = parameters.get(attr)
                if new is param:
                    continue
                i = next(i for i, p in enumerate(self.gathered_params) if p is param)
                self._adopt_replacement(i, new)
                param.requires_grad_(new.requires_grad)  # (followed by both at the unit's next use)
                parameters[attr] = param
                replaced.append(self.slots[i].names[0])
        return replaced

    def _adopt_replacement(self, i: int, new: Optional[Tensor]) -> None:
        view, name = self._gathered_view(i), self.slots[i].names[0]
        if new is None or new.shape != view.shape or new.dtype != view.dtype:
            given = "None" if new is None else f"a {new.dtype} tensor of shape {tuple(new.shape)}"
            raise RuntimeError(
                f"lightning_shard: {name!r} was replaced by {given} where the sharded model holds a {view.dtype} one of"
                f" shape {tuple(view.shape)}: sharding keeps a parameter's shape and dtype. Give it values of that"
                " shape and dtype (`p.copy_(...)` under torch.no_grad()), or change the model before sharding.")
        view.copy_(new.detach())

    def _gathered_view(self, i: int) -> Tensor:
        slot = self.slots[i]
        return self.gathered_data[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def _shard_view(self, i: int) -> Tensor:
        return self.shard[slice(*self.shard_range(self.slots[i]))]

    def _adopt_rebound(self, params: list[nn.Parameter], storage: torch.UntypedStorage,
                       view_of: Callable[[int], Tensor]) -> None:
        """``params`` (each slot's, in order) no longer in ``storage`` copied into their view there (``view_of``: slot
        index -> view), and viewing it."""
        home = storage.data_ptr()
        for i, (slot, param) in enumerate(zip(self.slots, params)):
            if param.untyped_storage().data_ptr() == home:
                continue
            view = view_of(i)
            if param.shape != view.shape:
                raise RuntimeError(
                    f"lightning_shard: {slot.names[0]!r} was given a tensor of shape {tuple(param.shape)} (`.data ="
                    f" ...`) where the sharded model holds one of shape {tuple(view.shape)}: give it values with"
                    " `p.copy_(...)` under torch.no_grad() or `load_pretrained`, or before the model is sharded.")
            view.copy_(param.data)
            param.data = view

    def shards_changed(self) -> None:
        """The shards were written (an optimizer step, a load): copies of them elsewhere are stale."""

    def grad_to_host(self, reduced: Tensor) -> Tensor:
        """Where the reduced gradient shard is accumulated: here, where it is (offloaded: host memory)."""
        return reduced

    def await_host_grads(self) -> None:
        """Before the host reads what :meth:`grad_to_host` returned (offloaded: its copy has landed)."""

    # -- module attributes --------------------------------------------------------------------------
    def use_gathered(self) -> None:
        for parameters, gathered in self._gathered_in_tree:
            parameters.update(gathered)
        for parameters in self.sole_trees:
            parameters.__class__ = GatheredParameters

    def use_shards(self) -> None:
        for parameters, shards in self._shards_in_tree:
            parameters.update(shards)
        for parameters in self.sole_trees:
            parameters.__class__ = ShardParameters

    # -- gradients ----------------------------------------------------------------------------------
    def sync_requires_grad(self) -> list[nn.Parameter]:
        """Follow ``requires_grad`` changed since the last call on either parameter of a slot: the shard (what the
        optimizer and, between steps, ``named_parameters()`` hold: ``toggle_optimizer``, a fine-tuning callback)
        or the gathered one (registered in the tree while the unit is gathered). Returns the gathered parameters
        that became trainable. ``ParamSlot.requires_grad`` stays the value at setup."""
        if [p.requires_grad for p in self._both_params] == self._both_requires_grad:
            return []  # the usual case, checked at every use of the unit: as cheap as it gets in Python
        unfrozen, changed = [], False
        for i, (shard, gathered) in enumerate(zip(self.shard_params, self.gathered_params)):
            if shard.requires_grad != self.requires_grad[i] or gathered.requires_grad != self.requires_grad[i]:
                flag = self.requires_grad[i] = not self.requires_grad[i]
                shard.requires_grad_(flag)
                gathered.requires_grad_(flag)
                if flag:
                    _refuse_autograd_grads(shard, self.slots[i])
                unfrozen += [gathered] if flag else []
                changed = True
        if changed:
            self.trainable = [i for i, trains in enumerate(self.requires_grad) if trains]
            self._both_requires_grad = self.requires_grad * 2
        return unfrozen
