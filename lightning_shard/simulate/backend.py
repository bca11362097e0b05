"""A simulated process group: world N in one process on one device, registered with ``torch.distributed`` as the
backend ``"lightning_shard_sim"`` (from Python, as torch registers its ``fake`` and ``threaded`` groups).

    from lightning_shard.simulate.backend import start
    start(world=8, link="h100-nvlink")      # this process is rank 0 of 8; init_process_group done
    runtime = shard_module(model, ...)      # or fully_shard(model, mesh=init_device_mesh("cuda", (8,)))

Each collective moves no data: its outputs are stand-ins (standins.py: what every rank would get if every rank held
this rank's values) and it occupies the stream it is issued on for the time the cost model gives (links.py,
occupancy.py). Shards are 1/N of their real size and gathered units whole, so this rank's memory is real. Groups built
later (``new_group``, a 2-D ``DeviceMesh``) are simulated too: a group within one node uses the node's link, one
spanning nodes the network's. ``ledger`` counts every collective: calls, bytes, modeled seconds and the stand-ins'
device writes per kind; ``links`` calls and seconds per link.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.simulate import standins
from lightning_shard.simulate.links import Link, Topology, link
from lightning_shard.simulate.occupancy import Occupancy

BACKEND = "lightning_shard_sim"


@dataclass
class Simulation:
    topology: Topology
    occupancy: Occupancy
    # kind -> [calls, bytes (nccl-tests' size), modeled seconds, bytes the stand-ins wrote]
    ledger: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0.0, 0]))
    links: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))  # calls, seconds

    def reset_ledger(self) -> None:
        self.ledger.clear()
        self.links.clear()


_simulation: Optional[Simulation] = None


def simulation() -> Simulation:
    if _simulation is None:
        raise RuntimeError(f"the {BACKEND!r} backend is not configured: call lightning_shard.simulate.backend.start()"
                           " (or configure()) before init_process_group")
    return _simulation


def configure(node: Union[str, Link] = "h100-nvlink", network: Union[str, Link] = "ib-ndr", per_node: int = 8,
              sharing: str = "serial") -> Simulation:
    """What the groups built from now on simulate: ``node`` link within ``per_node`` ranks, ``network`` across (a
    preset's name, or a :class:`Link` of one's own)."""
    global _simulation
    if per_node < 1:
        raise ValueError(f"per_node must be >= 1, got {per_node}")
    node, network = (x if isinstance(x, Link) else link(x) for x in (node, network))
    _simulation = Simulation(Topology(node, network, per_node), Occupancy(sharing))
    register()
    return _simulation


def register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def start(world: int, rank: int = 0, link: Union[str, Link] = "h100-nvlink", network: Union[str, Link] = "ib-ndr",
          per_node: int = 8,
          sharing: str = "serial", device: Optional[torch.device] = None) -> Simulation:
    """Configure the simulation and make it the default process group: this process is ``rank`` of ``world``. On a
    CUDA ``device`` the spin kernel is calibrated here, before any training work is queued."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"world must be >= 1 and 0 <= rank < world, got world={world}, rank={rank}")
    sim = configure(link, network, per_node, sharing)
    dist.init_process_group(BACKEND, rank=rank, world_size=world, store=dist.HashStore())
    if device is not None and device.type == "cuda" and sim.topology.node.busbw:
        sim.occupancy.spin(device)
    return sim


def _create(common: Any, options: Any) -> "SimulatedGroup":
    ranks = list(common.global_ranks_in_group or range(common.group_size))
    return SimulatedGroup(common.group_rank, common.group_size, simulation().topology.link_of(ranks))


def _first(*tensors: Any) -> Tensor:
    for t in tensors:
        while isinstance(t, (list, tuple)):
            t = t[0] if t else None
        if isinstance(t, Tensor):
            return t
    return torch.empty(0)


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


class SimulatedGroup(dist.ProcessGroup):
    """One simulated group: this rank's view of ``size`` ranks on ``link``. Method names as torch calls them, both
    torch >= 2.12's (``all_gather_single``...) and the older ones (``_allgather_base``...)."""

    def __init__(self, rank: int, size: int, on: Link) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self.link = rank, size, on

    def getBackendName(self) -> str:
        return BACKEND

    # the name torch gives a group lives on its C++ backend, which a group written in Python has not (torch's
    # threaded group keeps it in Python too)
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")

    def name(self) -> str:
        return BACKEND

    def _done(self, kind: str, size: int, written: int, result: list, device: torch.device) -> dist.Work:
        sim = simulation()
        seconds = self.link.seconds(kind, size, self._size)
        entry = sim.ledger[kind]
        entry[0] += 1
        entry[1] += size
        entry[2] += seconds
        entry[3] += written
        on = sim.links[self.link.name]
        on[0] += 1
        on[1] += seconds
        return sim.occupancy.occupy(self.link.name, seconds, device, written, result)

    # -- the collectives the engine and FSDP2 use ---------------------------------------------------------------
    def all_gather_single(self, output: Tensor, shard: Tensor, opts: Any = None) -> dist.Work:
        written = standins.all_gather(output, shard, self._size)
        return self._done("all_gather", _nbytes(output), written, [output], output.device)

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output: Tensor, flat: Tensor, opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        written = standins.reduce_scatter(output, flat, self._size, self._rank, op)
        return self._done("reduce_scatter", _nbytes(flat), written, [output], output.device)

    _reduce_scatter_base = reduce_scatter_single

    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        written = sum(standins.all_reduce(t, self._size, op) for t in tensors)
        return self._done("all_reduce", _nbytes(tensors), written, tensors, _first(tensors).device)

    allreduce_coalesced = allreduce

    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        return self._done("broadcast", _nbytes(tensors), 0, tensors, _first(tensors).device)

    def all_to_all_single(self, output: Tensor, flat: Tensor, output_splits: Any = None, input_splits: Any = None,
                          opts: Any = None) -> dist.Work:
        written = standins.all_to_all(output, flat)
        return self._done("all_to_all", _nbytes(flat), written, [output], output.device)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> dist.Work:
        written = sum(standins.all_to_all(o, i) for o, i in zip(outputs, inputs))
        return self._done("all_to_all", _nbytes(inputs), written, outputs, _first(outputs).device)

    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> dist.Work:
        written = sum(standins.fill_each(outs, value) for outs, value in zip(outputs, inputs))
        return self._done("all_gather", _nbytes(outputs), written, outputs, _first(inputs).device)

    allgather_coalesced = allgather

    def all_gather_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> dist.Work:
        written = sum(standins.all_gather(o, i, self._size) for o, i in zip(outputs, inputs))
        return self._done("all_gather", _nbytes(outputs), written, outputs, _first(outputs).device)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        written = sum(standins.reduce_scatter(o, i, self._size, self._rank, op) for o, i in zip(outputs, inputs))
        return self._done("reduce_scatter", _nbytes(inputs), written, outputs, _first(outputs).device)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs: list[Tensor], inputs: list[list[Tensor]], opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        written = 0
        for out, pieces in zip(outputs, inputs):
            written += standins.reduce_scatter(out, torch.stack([p.reshape(-1) for p in pieces]), self._size,
                                               self._rank, op)
        return self._done("reduce_scatter", _nbytes(inputs), written, outputs, _first(outputs).device)

    def reduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        written = sum(standins.all_reduce(t, self._size, op) for t in tensors) if opts is None or \
            opts.rootRank == self._rank else 0
        return self._done("all_reduce", _nbytes(tensors), written, tensors, _first(tensors).device)

    def gather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> dist.Work:
        written = sum(standins.fill_each(outs, value) for outs, value in zip(outputs, inputs))
        return self._done("all_gather", _nbytes(inputs) * self._size, written, outputs, _first(inputs).device)

    def scatter(self, outputs: list[Tensor], inputs: list[list[Tensor]], opts: Any = None) -> dist.Work:
        written = 0
        if inputs and inputs[0]:
            written = sum(standins.fill_each([o], pieces[self._rank]) for o, pieces in zip(outputs, inputs))
        return self._done("broadcast", _nbytes(outputs), written, outputs, _first(outputs).device)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._done("all_reduce", 0, 0, [], torch.device("cpu"))

    def send(self, tensors: list[Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._done("broadcast", _nbytes(tensors), 0, tensors, _first(tensors).device)

    def recv(self, tensors: list[Tensor], src: int, tag: int = 0) -> dist.Work:
        written = sum(standins.received(t) for t in tensors)
        return self._done("broadcast", _nbytes(tensors), written, tensors, _first(tensors).device)

    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> dist.Work:
        return self.recv(tensors, 0, tag)
