"""The cost model of a simulated collective, and the links users have, each figure cited.

A collective over ``n`` ranks moving ``size`` bytes takes

    latency + size x factor(kind, n) / busbw(kind)

with ``size`` and the factors as nccl-tests defines them (its doc/PERFORMANCE.md): ``size`` is the all-gather's
output, the reduce-scatter's input, the all-reduce's and the broadcast's tensor, the all-to-all's input; the factor
is (n-1)/n for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce, 1 for broadcast. ``busbw`` is
the bus bandwidth nccl-tests reports at large sizes, ``latency`` its time for the smallest message. A group whose
ranks lie on one node uses the node's link; a group that spans nodes, the network's (its slowest hop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
GB = 1e9


@dataclass(frozen=True)
class Link:
    name: str
    what: str
    latency: float  # seconds
    busbw: dict[str, float] = field(default_factory=dict)  # bytes/s per kind
    source: str = ""

    def seconds(self, kind: str, size: int, ranks: int) -> float:
        """Modeled time of one collective of ``kind`` over ``ranks`` ranks moving ``size`` bytes (see the module note)."""
        if ranks <= 1 or not self.busbw:
            return 0.0
        factor = {"all_reduce": 2 * (ranks - 1) / ranks, "broadcast": 1.0}.get(kind, (ranks - 1) / ranks)
        return self.latency + size * factor / self.busbw[kind]


def _uniform(busbw: float, all_reduce: float | None = None) -> dict[str, float]:
    return {kind: (all_reduce if kind == "all_reduce" and all_reduce else busbw) * GB for kind in KINDS}


# NVLink 4 through NVSwitch: 450 GB/s a direction on the wire, ~370 GB/s of bus bandwidth after NCCL's protocol
# overhead for every collective but all-reduce, which NVLink SHARP (NVLS) takes to ~480 on 8 GPUs.
_NVLINK4 = ("NVIDIA/nccl-tests#212 (an NCCL maintainer, 2024-05-06: 370 GB/s busbw for non-allreduce collectives and"
            " ring all-reduce on H100 NVLink, ~480 GB/s for NVLS all-reduce on 8 GPUs); latency: nccl-tests all_reduce"
            " at 4 B on 8 NVLink-4 GPUs (H20), 12.5 us, deepseek-ai/DeepEP#303")
LINKS = {
    "h100-nvlink": Link("h100-nvlink", "8 H100 SXM in one node, NVLink 4 through NVSwitch", 12.5e-6,
                        _uniform(370, all_reduce=480), _NVLINK4),
    "h200-nvlink": Link("h200-nvlink", "8 H200 SXM in one node, NVLink 4 through NVSwitch", 12.5e-6,
                        _uniform(370, all_reduce=475),
                        "NVIDIA/nccl-tests#272 (8 H200, NCCL 2.20.3: all-reduce busbw peaks at 475 GB/s); the other"
                        " collectives as on H100's NVLink 4, " + _NVLINK4),
    "pcie": Link("pcie", "8 GPUs on PCIe 5.0 through the host, no NVLink", 42.1e-6, _uniform(28),
                 "NVIDIA/nccl#1639 (8 RTX 5090 on PCIe 5.0: all-reduce busbw 28 GB/s; an NCCL maintainer: on PCI"
                 " systems the host's CPU and memory bound it); latency: NVIDIA/nccl#1530 (8 RTX 4090 on PCIe,"
                 " all_reduce at 8 B: 42.1 us)"),
    "ib-ndr": Link("ib-ndr", "between nodes: InfiniBand NDR, 400 Gb/s, one NIC per GPU", 47.5e-6, _uniform(46),
                   "NVIDIA/nccl-tests#290 (an NVIDIA engineer: 'for NDR @ 400Gbps you should see 46-48GB/s per NIC');"
                   " latency: NVIDIA/nccl#1244 (2 nodes x 8 H20, NDR: all-reduce at 4 B, 47.5 us)"),
    "zero": Link("zero", "no cost: every collective is free (the per-rank compute alone)", 0.0, {}, "-"),
}
NODE_LINKS = tuple(name for name in LINKS if name != "ib-ndr")


def link(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}: one of {', '.join(LINKS)}") from None


@dataclass(frozen=True)
class Topology:
    """Where the simulated ranks sit: ``per_node`` ranks to a node on ``node`` link, nodes joined by ``network``."""

    node: Link
    network: Link = LINKS["ib-ndr"]
    per_node: int = 8

    def link_of(self, ranks: list[int]) -> Link:
        """The link a group of these global ranks communicates over."""
        if self.node.name == "zero":
            return self.node
        return self.node if len({r // self.per_node for r in ranks}) <= 1 else self.network
