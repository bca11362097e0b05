"""The collectives the engine uses, as free functions that also count what they move.

They know nothing of modules or hooks: a flat buffer goes in, a flat buffer (or a work handle) comes out.
``async_op=True`` returns a :class:`Pending` whose ``wait()`` is accounted as exposed communication.
Host tensors (offloaded state) given to a backend that reads device tensors only (NCCL) go through a device copy.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.12 names them *_single; the older names warn as deprecated there.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Communication of the current step (reset by the runtime at each step)."""

    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0
    collectives: int = 0
    exposed_seconds: float = 0.0  # time the compute path spent blocked in wait()
    skipped_gathers: int = 0  # backward all-gathers found unnecessary (see ShardRuntime) and not issued
    agreements: int = 0  # tiny all-reduces by which the ranks share a decision (not counted as bytes above)
    broadcast_bytes: int = 0  # buffers (BatchNorm running stats ...) sent from rank 0
    all_to_all_bytes: int = 0  # whole parameters to and from their owners (matrix optimizers), sent by this rank
    # the gradient shards' all-reduce across replicas (hybrid: between shard groups, i.e. nodes; "none": all ranks);
    # not in all_reduce_bytes, which counts the rest (norms, finiteness)
    cross_group_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        """The fields, and ``in_group_bytes``: what moved within shard groups (gathers, reduce-scatters, owners)."""
        return {**self.__dict__,
                "in_group_bytes": self.all_gather_bytes + self.reduce_scatter_bytes + self.all_to_all_bytes}

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer died, stopped calling collectives, or the network broke."""


@dataclass
class Pending:
    """An in-flight collective and the buffers it must keep alive until it completes."""

    work: Optional[dist.Work]
    result: Tensor
    stats: CommStats
    keep_alive: tuple = field(default_factory=tuple)
    version_guard: Optional[Any] = None  # restores the output's autograd version once the data has landed
    label: str = ""  # what the collective was for, for error messages
    copy_back: Optional[tuple[Tensor, Tensor]] = None  # (host result, its device copy the collective wrote)

    @property
    def has_work_left(self) -> bool:
        """Whether :meth:`wait` has anything to do (else the result is there as issued)."""
        return self.work is not None or self.copy_back is not None or self.version_guard is not None

    def wait(self) -> Tensor:
        if self.work is not None:
            start = time.perf_counter()
            with _naming_failures(self.label, start):
                self.work.wait()
            self.stats.exposed_seconds += time.perf_counter() - start
            self.work = None
            self.keep_alive = ()
        if self.copy_back is not None:
            host, staged = self.copy_back
            host.copy_(staged)
            self.copy_back = None
        if self.version_guard is not None:
            self.version_guard.__exit__(None, None, None)
            self.version_guard = None
        return self.result


@contextmanager
def _naming_failures(label: str, start: float) -> Iterator[None]:
    try:
        yield
    except Exception as err:  # gloo/NCCL raise RuntimeError or DistBackendError, with little context
        waited = time.perf_counter() - start
        raise CollectiveError(
            f"lightning_shard: {label} failed after {waited:.1f}s on rank {_rank()}: {err}. A peer rank probably"
            " died or stopped calling collectives; the bound is the process group timeout (ShardStrategy(timeout=...))."
        ) from err


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


_DEVICE_ONLY_BACKENDS = ("nccl",)


def on_backend_device(tensor: Tensor, group, values: bool = True) -> Tensor:
    """``tensor`` where ``group``'s backend reads it: under NCCL a device copy of a host tensor (``values=False``:
    an output, allocated there without its values), else itself."""
    if tensor.device.type != "cpu" or str(dist.get_backend(group)) not in _DEVICE_ONLY_BACKENDS:
        return tensor
    device = torch.device("cuda", torch.cuda.current_device())
    return tensor.to(device) if values else torch.empty_like(tensor, device=device)


def _run(launch: Callable[..., Optional[dist.Work]], result: Tensor, stats: CommStats, async_op: bool,
         keep_alive: tuple = (), label: str = "", written: Optional[Tensor] = None) -> Pending:
    """``written``: the device copy of the host ``result`` that the collective writes (see on_backend_device)."""
    stats.collectives += 1
    start = time.perf_counter()
    copy_back = (result, written) if written is not None and written is not result else None
    with _naming_failures(label, start):
        if async_op:
            return Pending(launch(async_op=True), result, stats, keep_alive, label=label, copy_back=copy_back)
        launch()
    stats.exposed_seconds += time.perf_counter() - start
    pending = Pending(None, result, stats, label=label, copy_back=copy_back)
    pending.wait()
    return pending


def all_gather(output: Tensor, shard: Tensor, group, stats: CommStats, async_op: bool = False,
               label: str = "all-gather") -> Pending:
    """Gather every rank's ``shard`` into ``output`` (rank-major)."""
    # Note: refilling a gathered parameter's storage is not an autograd-visible change of its value, but
    # the collective bumps the output's version counter (gloo does so when the work completes), which
    # would fail autograd's check on tensors saved for backward. The version is restored after wait().
    guard = torch.autograd._unsafe_preserve_version_counter(output)
    stats.all_gather_bytes += output.numel() * output.element_size()
    into, shard = on_backend_device(output, group, values=False), on_backend_device(shard, group)
    with torch.no_grad():
        pending = _run(functools.partial(_all_gather, into, shard, group=group), output, stats, async_op, (shard,),
                       label, written=into)
    pending.version_guard = guard
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter(flat: Tensor, group, stats: CommStats, async_op: bool = False,
                   label: str = "reduce-scatter") -> Pending:
    """Sum ``flat`` over ranks; this rank receives its 1/N slice."""
    world = dist.get_world_size(group)
    flat = on_backend_device(flat, group)
    output = flat.new_empty(flat.numel() // world)
    stats.reduce_scatter_bytes += flat.numel() * flat.element_size()
    launch = functools.partial(_reduce_scatter, output, flat, op=dist.ReduceOp.SUM, group=group)
    return _run(launch, output, stats, async_op, (flat,), label)


def all_reduce(flat: Tensor, group, stats: CommStats, async_op: bool = False, label: str = "all-reduce",
               op: dist.ReduceOp = dist.ReduceOp.SUM, across_replicas: bool = False) -> Pending:
    """Reduce ``flat`` over ranks (a sum unless ``op`` says otherwise), in place. ``across_replicas``: counted as
    ``cross_group_bytes`` (the gradients' all-reduce between replicas)."""
    moved = 2 * flat.numel() * flat.element_size()  # a reduce-scatter plus an all-gather
    if across_replicas:
        stats.cross_group_bytes += moved
    else:
        stats.all_reduce_bytes += moved
    staged = on_backend_device(flat, group)
    launch = functools.partial(dist.all_reduce, staged, op=op, group=group)
    return _run(launch, flat, stats, async_op, label=label, written=staged)


def all_to_all(output: Tensor, flat: Tensor, output_splits: list[int], input_splits: list[int], group,
               stats: CommStats, async_op: bool = False, label: str = "all-to-all") -> Pending:
    """Rank ``r`` receives ``flat``'s ``input_splits[r]`` elements from every rank, in rank order, into ``output``."""
    stats.all_to_all_bytes += flat.numel() * flat.element_size()
    into, flat = on_backend_device(output, group, values=False), on_backend_device(flat, group)
    launch = functools.partial(dist.all_to_all_single, into, flat, output_splits, input_splits, group=group)
    return _run(launch, output, stats, async_op, (flat,), label, written=into)


def gather_pieces(out: Optional[Tensor], piece: Tensor, bounds: list[tuple[int, int]], group, stats: CommStats,
                  label: str = "gather of pieces") -> None:
    """The group's first rank receives every rank's ``piece`` into ``out[bounds[rank]]`` (a flat tensor), point to
    point: it needs no staging buffer beyond ``out``. The others send theirs (``out`` is theirs to ignore)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    stats.collectives += 1
    with _naming_failures(label, time.perf_counter()):
        if dist.get_rank(group) == 0:
            assert out is not None
            lo, hi = bounds[0]
            out[lo:hi].copy_(piece)
            into = on_backend_device(out, group, values=False)  # out itself, unless NCCL receives on the device
            works = [dist.irecv(into[lo:hi], src=ranks[r], group=group) for r, (lo, hi) in enumerate(bounds)
                     if r and hi > lo]
            for work in works:
                work.wait()
            if into is not out:
                for r, (lo, hi) in enumerate(bounds):
                    if r and hi > lo:
                        out[lo:hi].copy_(into[lo:hi])
        elif piece.numel():
            dist.isend(on_backend_device(piece.contiguous(), group), dst=ranks[0], group=group).wait()


def broadcast(flat: Tensor, group, stats: CommStats, label: str = "broadcast", src: int = 0) -> Tensor:
    """Rank ``src``'s ``flat`` (its rank in ``group``) on every rank, in place."""
    stats.broadcast_bytes += flat.numel() * flat.element_size()
    src = dist.get_global_rank(group, src) if group is not None else src
    staged = on_backend_device(flat, group)
    launch = functools.partial(dist.broadcast, staged, src=src, group=group)
    return _run(launch, flat, stats, False, label=label, written=staged).result


def agree(flags: Tensor, group, stats: CommStats, label: str) -> Tensor:
    """The elementwise max of a small flag tensor over all ranks, in place: a decision every rank shares."""
    return start_agreement(flags, group, stats, label).wait()


def start_agreement(flags: Tensor, group, stats: CommStats, label: str) -> Pending:
    """:func:`agree` in flight, for a check that is needed only later: ``wait()`` gives the result."""
    stats.agreements += 1
    staged = on_backend_device(flags, group)
    launch = functools.partial(dist.all_reduce, staged, op=dist.ReduceOp.MAX, group=group)
    return _run(launch, flags, stats, True, label=label, written=staged)


def from_every_rank(value: Any, group=None, stats: Optional[CommStats] = None,
                    label: str = "exchange of small objects") -> list[Any]:
    """Every rank's picklable ``value``, in rank order (just ``[value]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [value]
    everyone: list = [None] * dist.get_world_size(group)
    if stats is not None:
        stats.collectives += 1
    with _naming_failures(label, time.perf_counter()):
        dist.all_gather_object(everyone, value, group=group)
    return everyone


def fingerprint(values: list[int]) -> int:
    """A hash of a list of small ints that fits int64, for agreements: ranks compare ``[h, -h]`` under MAX."""
    value = 0
    for i in values:
        value = fingerprint_step(value, i)
    return value


def fingerprint_step(value: int, i: int) -> int:
    """:func:`fingerprint` of a list from that of the list without its last value ``i``."""
    return (value * 1_000_003 + i + 1) % (2**61 - 1)
