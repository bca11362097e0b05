"""The sharded optimizer step: the user's optimizer run group by group (``step_plan.py``), and for
whole-parameter optimizers (Muon, Adafactor, LAMB) each parameter stepped whole on its owner rank.

Between steps the optimizer holds the 1-D shard parameters, whatever its kind, so everything that reads or
writes gradients before the step (norm clipping, the gradient scaler's unscale, the nonfinite check, the
user's gradient logging, ``zero_grad``) sees the shards as it always does. Only inside the step are its param
groups swapped for what is being stepped. Per group of an ``owners`` plan::

    all-to-all: every rank's pieces of the values and averaged gradients -> each parameter's owner
    owner: the user's optimizer steps the full-shape tensors (its state in the parameter's real shape)
    all-to-all: the new values -> every rank's shards

The next group's exchange is in flight while the owner steps this one, and this one's return while it steps
the next. Before that, the ranks agree on what their optimizers hold (``optimizer_groups.py``): a step, and an
owner plan, are then the same on every rank. The state of a whole-stepped parameter is kept under its shard parameter (``optimizer.state[shard]``),
on its owner only: 1/N of the optimizer state per rank in aggregate, as for elementwise optimizers.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats, Pending
from lightning_shard.engine.comm.groups import ShardGroups
from lightning_shard.engine.optim.fused_default import FusedWhereUnchosen
from lightning_shard.engine.optim.optimizer_groups import agree_on_groups
from lightning_shard.engine.optim.step_plan import OWNERS, SHARDS, VIEWS, Bucket, Entry, StepPlan, params_key, plan_step
from lightning_shard.engine.storage.flat_shard import FlatShard

DEFAULT_STEP_GROUP_NUMEL = 2**25  # parameter elements per rank stepped at once (128 MiB of fp32 per state tensor)


class ShardedStep:
    """``optimizer.step`` for a sharded model (the strategy calls it in place of the optimizer's own)."""

    def __init__(self, optimizer: Optimizer, whole: bool, where: dict[int, tuple[int, FlatShard, int]],
                 groups: ShardGroups, stats: CommStats, group_numel: int) -> None:
        self.optimizer = optimizer
        self.whole = whole
        self.where = where  # id(shard parameter) -> (unit index, storage, slot)
        self.groups = groups
        self.group, self.world = groups.shard, groups.shard_size  # the owners' exchanges
        self.rank = dist.get_rank(self.group) if self.world > 1 else 0
        self.stats = stats
        self.group_numel = group_numel
        self._plan: Optional[StepPlan] = None
        self._running = False
        # the model's parameters by position, name and shard, for the ranks' agreement on the param groups
        self._index = {key: i for i, key in enumerate(where)}
        self.names = {key: storage.slots[slot].names[0] for key, (_, storage, slot) in where.items()}
        self._shards = {storage.slots[slot].names[0]: storage.shard_params[slot] for _, storage, slot in where.values()}
        # the gathered parameters a unit's modules hold mid-step (what a group added then holds), to their shards
        self._shard_of = {id(storage.gathered_params[slot]): storage.shard_params[slot]
                          for _, storage, slot in where.values()}
        self._membership: list = []  # the groups' fingerprint of membership, for their current parameters
        self.groups_merged = 0  # how many times the ranks' param groups differed and were merged
        self.on_merge: Optional[Callable[[], None]] = None  # told after each merge (the strategy's records)
        self.before_step: Optional[Callable[[], None]] = None  # after the closure: the gradients whole (the runtime's)
        self._owners: dict[int, int] = {}  # id(shard parameter) -> the owner any plan gave it: its state is there
        # torch's fused kernel where the groups chose no implementation (on a GPU; offload: on the CPU)
        self.fused: Optional[FusedWhereUnchosen] = None
        self.host_stepper: Any = None  # offload's overlapped step (host_step.py): may have stepped already
        self.describe: Callable[[Tensor], str] = lambda p: f"a tensor of shape {tuple(p.shape)}"  # (attach names them)
        if whole:  # its own ``step`` would step 1-D shards, or nothing: only this one may run
            optimizer.register_step_pre_hook(self._refuse_own_step)

    def __call__(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:  # first, as every torch optimizer does: the gradients come from it
            with torch.enable_grad():
                loss = closure()
        if self.before_step is not None:
            self.before_step()
        # the optimizer's step hooks run once around the whole step, as for an unsharded ``step()``
        self._running = True
        try:
            Optimizer.profile_hook_step(self._step)(self.optimizer, **kwargs)
        finally:
            self._running = False
        self.optimizer._opt_called = True  # what an LR scheduler's wrapper of ``step`` notes (it warns otherwise)
        return loss

    def agree_on_groups(self) -> None:
        """Make the ranks' param groups the same (every rank must call it: the step, clipping, the gradient
        scaler and checkpoints do, before they read the groups), merging what sharding made differ
        (``optimizer_groups.py``); one tiny agreement when they are the same. A gathered parameter a group was
        given mid-step is replaced by its shard first. Offload's steps still to come are done first (they read and
        write the optimizer's state: host_step.py's ``finish_in_forward``)."""
        if self.host_stepper is not None:
            self.host_stepper.finish()
        for group in self.optimizer.param_groups:
            params = group["params"]
            if any(id(p) in self._shard_of for p in params):
                params[:] = [self._shard_of.get(id(p), p) for p in params]  # in place: the optimizer holds the list
        if self.groups.world_size > 1 and agree_on_groups(self.optimizer, self._index, self.names, self._shards,
                                                          self.groups.agreements, self.stats, self._membership):
            self.groups_merged += 1
            if self.on_merge is not None:
                self.on_merge()

    def shard_of(self, param: Tensor) -> Tensor:
        """``param``'s shard parameter if it is a gathered one, else ``param``."""
        return self._shard_of.get(id(param), param)

    def plan(self) -> StepPlan:
        """The plan for the optimizer's current parameters, planned again when its param groups change
        (``add_param_group``). The same on every rank once they agreed on the groups."""
        if self._plan is None or self._plan.key != params_key(self.optimizer):
            refuse_foreign(self.optimizer, self.where, self.describe)  # (a param group added since)
            whole_shards = not self.whole and _steps_parameter_by_parameter(self.optimizer)
            self._plan = plan_step(self.optimizer, self.where, self.whole, self.world,
                                   2**62 if whole_shards else self.group_numel, self._owners)
            self._owners.update(self._plan.owners)
        return self._plan

    def owner(self, param: Tensor) -> Optional[int]:
        """The rank holding ``param``'s state, or None when every rank holds its own."""
        return self.plan().owner(param) if self.whole else None

    def _refuse_own_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not self._running:
            raise RuntimeError(
                f"lightning_shard: {type(optimizer).__name__} steps whole parameters on their owner ranks; its own"
                " `step()` would see 1-D shards. With Lightning, `optimizer.step()` inside a LightningModule does the"
                " right thing; with the engine alone call `runtime.step(optimizer)`.")

    @torch.no_grad()
    def _step(self, optimizer: Optimizer, **kwargs: Any) -> None:
        """``kwargs``: what the caller gave ``step`` besides the closure, for every group's step."""
        self.agree_on_groups()
        if self.host_stepper is not None and self.host_stepper.armed_for(self) and self.host_stepper.commit():
            if self.optimizer._optimizer_step_post_hooks or _global_optimizer_post_hooks:
                self.host_stepper.finish()  # (they run as step() returns, and may read the optimizer's state)
            return  # stepped unit by unit during backward (and after, finish_in_forward)
        with self.fused() if self.fused is not None else nullcontext():
            self._step_buckets(optimizer, functools.partial(_raw_step(optimizer), **kwargs))

    def _step_buckets(self, optimizer: Optimizer, raw: Callable[[Optimizer], Any]) -> None:
        plan = self.plan()
        if len(plan.buckets) == 1 and plan.buckets[0].mode == SHARDS:
            raw(optimizer)  # one group holding every parameter as it is: nothing to swap
            return
        for bucket in plan.buckets:
            if bucket.mode == SHARDS:
                with _stepping(optimizer, [(e, e.param) for e in bucket.entries]):
                    raw(optimizer)
            elif bucket.mode == VIEWS:
                with _stepping(optimizer, [(e, _whole_view(e)) for e in bucket.entries]):
                    raw(optimizer)
        self._step_owned([b for b in plan.buckets if b.mode == OWNERS], optimizer, raw)

    def _step_owned(self, buckets: list[Bucket], optimizer: Optimizer, raw: Callable[[Optimizer], Any]) -> None:
        exchanges = [_OwnerExchange(b, self.rank, self.world) for b in buckets]
        incoming = exchanges[0].send_in(self.group, self.stats) if exchanges else None
        returning: list[tuple[_OwnerExchange, Pending]] = []
        for i, exchange in enumerate(exchanges):
            assert incoming is not None
            received = incoming.wait()
            incoming = exchanges[i + 1].send_in(self.group, self.stats) if i + 1 < len(exchanges) else None
            stepped = exchange.receive_in(received)
            with _stepping(optimizer, stepped):
                raw(optimizer)
            returning.append((exchange, exchange.send_out(stepped, self.group, self.stats)))
            if len(returning) > 1:
                done, pending = returning.pop(0)
                done.receive_out(pending.wait())
        for done, pending in returning:
            done.receive_out(pending.wait())


class _OwnerExchange:
    """The two all-to-alls of one ``owners`` bucket. Each rank's part of a parameter is a contiguous range of
    its flattened values, ranks in order, so an owner puts a parameter together by concatenation."""

    def __init__(self, bucket: Bucket, rank: int, world: int) -> None:
        self.bucket, self.rank, self.world = bucket, rank, world
        self.by_owner: list[list[Entry]] = [[] for _ in range(world)]
        for entry, owner in zip(bucket.entries, bucket.owners):
            self.by_owner[owner].append(entry)
        self.mine = self.by_owner[rank]
        # to the owners: values, then gradients, then one flag per parameter (it has a gradient here)
        self.send_in_splits = [2 * sum(e.piece_len(rank) for e in es) + len(es) for es in self.by_owner]
        self.recv_in_splits = [2 * sum(e.piece_len(r) for e in self.mine) + len(self.mine) for r in range(world)]
        self.send_out_splits = [sum(e.piece_len(r) for e in self.mine) for r in range(world)]
        self.recv_out_splits = [sum(e.piece_len(rank) for e in es) for es in self.by_owner]

    def send_in(self, group: Optional[dist.ProcessGroup], stats: CommStats) -> Pending:
        first = self.bucket.entries[0]
        dtype, device = first.param.dtype, first.param.device  # a bucket holds one dtype and device (step_plan.py)
        pieces: list[Tensor] = []
        for entries in self.by_owner:
            grads = [e.param.grad for e in entries]
            pieces += [e.local_values() for e in entries]
            pieces += [g if g is not None else torch.zeros(e.piece_len(self.rank), dtype=dtype, device=device)
                       for e, g in zip(entries, grads)]
            flags = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
            # on a GPU from pinned memory, without blocking: a pageable host-to-device copy waits for the device
            pieces.append(flags.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flags)
        flat = torch.cat(pieces)
        out = flat.new_empty(sum(self.recv_in_splits))
        return collectives.all_to_all(out, flat, self.recv_in_splits, self.send_in_splits, group, stats,
                                      async_op=True, label=f"all-to-all of {len(self.mine)} parameters to their owners")

    def receive_in(self, received: Tensor) -> list[tuple[Entry, nn.Parameter]]:
        """The owned parameters in full (values and gradients), as parameters for the optimizer."""
        sizes = [e.numel for e in self.mine]
        values = received.new_empty(sum(sizes)).split(sizes)
        grads = received.new_empty(sum(sizes)).split(sizes)
        flags = []
        for r, segment in enumerate(received.split(self.recv_in_splits)):
            lengths = [e.piece_len(r) for e in self.mine]
            parts = segment.split(lengths + lengths + [len(self.mine)])
            for i, entry in enumerate(self.mine):
                lo, hi = entry.piece(r)
                values[i][lo:hi] = parts[i]
                grads[i][lo:hi] = parts[len(lengths) + i]
            flags.append(parts[-1])
        has_grad = (torch.stack(flags) if flags else received.new_empty(0, 0)).bool().cpu()  # one host sync a group
        stepped = []
        for i, entry in enumerate(self.mine):
            param = nn.Parameter(values[i].view(entry.shape), requires_grad=entry.param.requires_grad)
            column = has_grad[:, i]
            if bool(column.all()):
                param.grad = grads[i].view(entry.shape)
            elif bool(column.any()):
                raise RuntimeError(
                    f"lightning_shard: {entry.name!r} has a gradient on ranks {column.nonzero().flatten().tolist()}"
                    " only: ranks must agree on which parameters have gradients (`.grad` set to None on some ranks)."
                )
            stepped.append((entry, param))
        return stepped

    def send_out(self, stepped: list[tuple[Entry, nn.Parameter]], group: Optional[dist.ProcessGroup],
                 stats: CommStats) -> Pending:
        flats = [param.detach().reshape(-1) for _, param in stepped]
        pieces = [flat[slice(*entry.piece(r))] for r in range(self.world) for (entry, _), flat in zip(stepped, flats)]
        flat = torch.cat(pieces) if pieces else self.bucket.entries[0].param.new_empty(0)
        out = flat.new_empty(sum(self.recv_out_splits))
        return collectives.all_to_all(out, flat, self.recv_out_splits, self.send_out_splits, group, stats,
                                      async_op=True, label="all-to-all of stepped parameters to their shards")

    def receive_out(self, received: Tensor) -> None:
        for entries, segment in zip(self.by_owner, received.split(self.recv_out_splits)):
            for entry, values in zip(entries, segment.split([e.piece_len(self.rank) for e in entries])):
                entry.local_values().copy_(values)


def _whole_view(entry: Entry) -> nn.Parameter:
    """A parameter in its real shape viewing this rank's shard, which holds all of it (one rank, or no sharding)."""
    param = nn.Parameter(entry.local_values().view(entry.shape), requires_grad=entry.param.requires_grad)
    if entry.param.grad is not None:
        param.grad = entry.param.grad.view(entry.shape)
    return param


@contextmanager
def _stepping(optimizer: Optimizer, stepped: list[tuple[Entry, Tensor]]) -> Iterator[None]:
    """The optimizer's param groups hold only ``stepped`` (each in its group), and their state is found under
    them; on exit the groups hold their own parameters again and the state goes back under those."""
    held = [list(group["params"]) for group in optimizer.param_groups]
    by_group: list[list[Tensor]] = [[] for _ in held]
    for entry, param in stepped:
        by_group[entry.group].append(param)
        if param is not entry.param and entry.param in optimizer.state:
            optimizer.state[param] = optimizer.state.pop(entry.param)
    for group, params in zip(optimizer.param_groups, by_group):
        group["params"][:] = params  # in place: an optimizer may keep a reference to the list
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, held):
            group["params"][:] = params
        for entry, param in stepped:
            if param is not entry.param and param in optimizer.state:
                state = optimizer.state.pop(param)
                if state:
                    optimizer.state[entry.param] = state


def _steps_parameter_by_parameter(optimizer: Optimizer) -> bool:
    """torch's optimizers loop over the parameters on the CPU unless told otherwise (``foreach=True``): their
    temporaries are one parameter's at a time already, and stepping in groups would only fragment host memory."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return all(p.device.type == "cpu" for p in params) and not any(g.get("foreach") for g in optimizer.param_groups)


def _raw_step(optimizer: Optimizer) -> Callable[[Optimizer], Any]:
    """The class's ``step`` without torch's hook wrapper (:class:`ShardedStep` runs the hooks once itself)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def refuse_foreign(optimizer: Optimizer, where: dict[int, Any], describe: Callable[[Tensor], str]) -> None:
    """Every tensor an optimizer of the sharded model holds must be one of the model's sharded parameters (``where``:
    their ids): any other (a module added after ``shard_module``, a tensor of the user's) gets each rank's own gradient,
    which no collective averages, and the ranks' copies would drift apart with every step."""
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in where]
    if foreign:
        raise ValueError(
            f"lightning_shard: {type(optimizer).__name__} holds {', '.join(describe(p) for p in foreign[:4])}, which"
            " are not parameters of the sharded model: each rank would step them with its own gradient, never"
            " averaged, and the ranks' copies would drift apart. Add such modules to the model before it is sharded"
            " (with Lightning: in the LightningModule's `__init__` or `configure_model`, not in `configure_optimizers`)"
            ", or leave them out of the optimizer.")
