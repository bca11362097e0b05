"""The Lightning side of a strategy that runs one process per device on a default process group of its own: its ranks
and devices as Lightning asks for them, the launcher, the group (a ProcessGroup part: process_group.py) and the
collectives Lightning calls. ShardStrategy builds on it; it knows nothing of sharding."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_shard.lightning.options import check_timeout
from lightning_shard.lightning.process_group import ProcessGroup


class ProcessGroupStrategy(ParallelStrategy):
    """A ParallelStrategy whose processes and default group are its ``processes`` part."""

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.processes = ProcessGroup(check_timeout(timeout), process_group_backend)
        self.num_nodes = 1

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:  # DistributedSampler injection and `sync_dist` depend on it
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        launcher = self.processes.launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        if launcher is not None:
            self._launcher = launcher

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self.processes.connect(self.cluster_environment, self.root_device)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def barrier(self, name: Optional[str] = None) -> None:
        self.processes.barrier(lambda: self.root_device)

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return self.processes.broadcast(obj, src)

    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        return self.processes.reduce(tensor, group, reduce_op)
