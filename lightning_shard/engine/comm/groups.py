"""The process groups a sharded model communicates over, by sharding mode.

* the **shard group**: a unit's parameters are split over it (all-gathers, reduce-scatters, the matrix
  optimizers' owner exchanges);
* the **replicate group**: the ranks holding the same shard, whose gradient shards are all-reduced;
* the **world**: every rank, for buffers and setup broadcasts;
* the **host group**: every rank over gloo, for the small agreements on what the host decides (which parameters
  were used, the trainable and param-group fingerprints): host values agreed without a device sync. Beside an
  NCCL world it is a gloo group of its own; over gloo, the world itself.

``full``/``grad_op``: the shard group is the world, no replicas. ``none``: no shard group, every rank a replica.
``hybrid`` (HSDP): groups of ``shard_size`` consecutive ranks shard, the groups replicate one another. Ranks
are numbered node by node (``node_rank * devices + local_rank``), so a shard group is a node by default and
only the gradient shards' all-reduce crosses nodes. Its groups come from a 2-D ``DeviceMesh``
``("replicate", "shard")``, as FSDP2's HSDP builds them.

Note: a group of one rank is held as ``None`` with size 1 and never communicated over (``None`` means the
world to ``torch.distributed``): every caller checks the size first.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SHARDING_MODES = ("full", "grad_op", "hybrid", "none")


@dataclass(frozen=True)
class ShardGroups:
    world: Optional[dist.ProcessGroup]  # the group shard_module was given (None: the default group)
    shard: Optional[dist.ProcessGroup]
    shard_size: int
    shard_rank: int
    replicate: Optional[dist.ProcessGroup]
    replicas: int
    mesh: Optional[DeviceMesh] = None  # hybrid only
    host: Optional[dist.ProcessGroup] = None  # a gloo group over the world's ranks, where the world is NCCL

    @property
    def agreements(self) -> Optional[dist.ProcessGroup]:
        """Where host values (CPU tensors, objects) are agreed: never a device sync."""
        return self.host if self.host is not None else self.world

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicas

    @property
    def shard_ranks(self) -> list[int]:
        """The global ranks of this rank's shard group, by shard rank (where checkpoints place the shards)."""
        if self.shard_size == 1:
            return [dist.get_rank() if dist.is_initialized() else 0]
        return dist.get_process_group_ranks(self.shard if self.shard is not None else dist.group.WORLD)


def validate_sharding(sharding: object) -> str:
    if sharding not in SHARDING_MODES:
        raise ValueError(f"`sharding` must be one of {', '.join(map(repr, SHARDING_MODES))}; got {sharding!r}.")
    return sharding  # type: ignore[return-value]


def validate_shard_size(shard_size: object, sharding: str) -> Optional[int]:
    if shard_size is None:
        return None
    if sharding != "hybrid":
        raise ValueError(f"`shard_size` is the size of hybrid sharding's groups: give it with sharding='hybrid',"
                         f" not {sharding!r}.")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"`shard_size` must be an int >= 1 (ranks per shard group, by default the devices per node),"
                         f" got {shard_size!r}.")
    return shard_size


def build_groups(sharding: str, group: Optional[dist.ProcessGroup], shard_size: Optional[int],
                 device: torch.device, mesh: Optional[DeviceMesh] = None) -> ShardGroups:
    """The groups for ``sharding`` over ``group`` (every rank must call it: hybrid creates process groups)."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    if sharding == "hybrid":
        groups = _hybrid(group, shard_size, device, mesh, world)
    elif sharding == "none":
        groups = ShardGroups(group, None, 1, 0, group, world)
    else:
        groups = ShardGroups(group, group, world, rank, None, 1)
    return dataclasses.replace(groups, host=_host_group(group, world))


# Set to 0 where gloo cannot connect the ranks (no usable interface; GLOO_SOCKET_IFNAME names one): the agreements
# then go over NCCL, as device tensors read by the host (a device sync each).
HOST_AGREEMENTS = "LIGHTNING_SHARD_HOST_AGREEMENTS"
_host_groups: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}  # id(world) -> (world, its gloo group)


def _host_group(group: Optional[dist.ProcessGroup], world: int) -> Optional[dist.ProcessGroup]:
    """A gloo group over the world's ranks where the world's backend reads device tensors only (NCCL), one per world
    (every sharded model of the process shares it); None where the world takes host tensors itself. Only for the
    default group: ``new_group`` must be called by every rank."""
    if world == 1 or (group is not None and group is not dist.group.WORLD):
        return None
    if str(dist.get_backend(group)) != "nccl":  # gloo, or "cpu:gloo,cuda:nccl": host tensors go over gloo already
        return None
    default = dist.group.WORLD
    cached = _host_groups.get(id(default))
    if cached is None or cached[0] is not default:  # (a world destroyed since, and its id reused)
        # new_group is a collective: one rank's environment must not decide it alone
        opted_out = torch.tensor([os.environ.get(HOST_AGREEMENTS) == "0"], dtype=torch.int32,
                                 device=torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(opted_out, op=dist.ReduceOp.MAX)
        if opted_out.item():
            return None
        timeout = _world_timeout()
        cached = _host_groups[id(default)] = (
            default, dist.new_group(backend="gloo", **({"timeout": timeout} if timeout is not None else {})))
    return cached[1]


def _hybrid(group: Optional[dist.ProcessGroup], shard_size: Optional[int], device: torch.device,
            mesh: Optional[DeviceMesh], world: int) -> ShardGroups:
    if mesh is not None:
        if mesh.ndim != 2:
            raise ValueError(f"lightning_shard: hybrid sharding takes a 2-D DeviceMesh (replicate, shard), got"
                             f" {mesh.ndim} dimensions.")
        if shard_size is not None and shard_size != mesh.size(1):
            raise ValueError(f"`shard_size={shard_size}` but the mesh's shard dimension has {mesh.size(1)} ranks.")
        shard_size = mesh.size(1)
    if shard_size is None:
        shard_size = _devices_per_node()
    if world % shard_size:
        raise ValueError(f"lightning_shard: sharding='hybrid' with shard_size={shard_size} over {world} ranks: the"
                         f" world size must be a multiple of `shard_size` (whole shard groups).")
    if world == 1:
        return ShardGroups(group, None, 1, 0, None, 1)
    if group is not None and group is not dist.group.WORLD:
        raise ValueError("lightning_shard: sharding='hybrid' builds its groups over every rank (a DeviceMesh);"
                         " pass `mesh=` (a 2-D DeviceMesh) instead of `group=`.")
    if mesh is None:
        mesh = init_device_mesh(device.type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"),
                                backend_override=_with_world_timeout())
    shard, replicate = mesh.get_group(1), mesh.get_group(0)
    return ShardGroups(group, shard if shard_size > 1 else None, shard_size, mesh.get_local_rank(1),
                       replicate if mesh.size(0) > 1 else None, mesh.size(0), mesh)


def _devices_per_node() -> int:
    """torchrun's and Lightning's LOCAL_WORLD_SIZE; without it the caller must say."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        raise ValueError("lightning_shard: sharding='hybrid' needs `shard_size` (ranks per shard group, usually the"
                         " GPUs per node): LOCAL_WORLD_SIZE is not set to take it from.")
    return int(value)


def _world_timeout() -> Optional[timedelta]:
    """The world group's timeout (``ShardStrategy(timeout=...)``), for the groups built beside it: ``new_group``
    would give them the backend's default (30 minutes for gloo), and a dead peer would go unnoticed for that long."""
    try:
        backend = dist.get_backend()
        timeout = dist.group.WORLD._get_backend(torch.device("cuda" if backend == "nccl" else "cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def _with_world_timeout() -> Optional[dict[str, Any]]:
    """The mesh's groups get the world group's timeout (see :func:`_world_timeout`)."""
    timeout = _world_timeout()
    if timeout is None:
        return None
    backend = dist.get_backend()
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    elif backend == "gloo":
        options = torch._C._distributed_c10d.Backend.Options("gloo", timeout)
    else:  # a mixed "cpu:gloo,cuda:nccl" backend: the defaults
        return None
    return {"replicate": (backend, options), "shard": (backend, options)}
