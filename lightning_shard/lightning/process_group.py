"""The processes and the process group of a ShardStrategy: launching, creating the default group (destroyed at
interpreter exit unless a run failed), the collectives Lightning asks a strategy for (logging, metrics,
decisions), and ending a stage without leaving a collective behind."""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor


class ProcessGroupMixin:
    """Mixed into ShardStrategy (a ParallelStrategy with ``_timeout`` and ``_process_group_backend``)."""

    _timeout: Optional[timedelta]
    _process_group_backend: Optional[str]
    complete_background_saves: Any  # (checkpointing.py)
    release_background_saves: Any

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        creates_group = not _distributed_is_initialized()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if creates_group:
            GROUP_AT_EXIT.adopt(torch.distributed.group.WORLD)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # -- collectives for Lightning (logging, metrics, decisions) ------------------------------------
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def teardown(self) -> None:
        # Unlike the base class, do not move the module to CPU: that would break its shard views.
        assert self.cluster_environment is not None and self.accelerator is not None
        if self._ended_cleanly():
            self._complete_inflight_gathers()
            try:  # async_save: a fit returns once its last save is complete (or raises)
                self.complete_background_saves()
            finally:  # its staging memory and thread given back (taken again at the next fit's setup)
                self.release_background_saves()
            self.barrier()  # no rank goes on to exit, closing its sockets, while another still communicates
        else:  # a peer may be dead or stuck in a collective: waiting on it, or destroying the group, could hang
            GROUP_AT_EXIT.failed = True
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    def _ended_cleanly(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED

    def _complete_inflight_gathers(self) -> None:
        """Wait for prefetched all-gathers a stage left in flight (a step cut short): no collective may
        outlive the stage, since work still pending at exit is freed by a backend thread in interpreter shutdown."""
        if self.runtime is None:
            return
        self.runtime.wait_host_steps()  # offload's steps still to come after the last optimizer step (and their errors)
        for unit in self.runtime.units:
            if unit.inflight is not None:
                self.runtime.schedule.reshard(unit)  # waits for it, then frees its buffer


class GroupAtExit:
    """Destroys, at interpreter exit, the default process group a ShardStrategy created, unless a run failed.

    Left to interpreter shutdown, the group's backend threads are torn down while Python is finalizing, when a
    thread that needs the GIL (to free a tensor it held) is killed inside a destructor: the process aborts with
    "terminate called without an active exception", most often when a peer has already exited and closed its
    sockets. Destroying the group while the interpreter is whole joins those threads cleanly. It is not done
    in ``teardown``: Trainer.validate/test after fit, and ``full_state_dict(strategy.runtime)``, still use the
    group (Lightning's DDPStrategy keeps it too). After a failure a peer may be stuck in a collective, and
    destroying could block on it: the process is exiting with an error anyway.
    """

    def __init__(self) -> None:
        self.group: Optional[weakref.ref] = None  # weak: a group the user destroys must not live on here
        self.failed = False
        self._registered = False

    def adopt(self, group: Any) -> None:
        self.group = weakref.ref(group)
        if not self._registered:
            atexit.register(self)
            self._registered = True

    def __call__(self) -> None:
        group = self.group() if self.group is not None else None
        # only the group created here: a later group (a user's re-init) is its creator's to destroy
        if group is None or self.failed or not _distributed_is_initialized():
            return
        if torch.distributed.group.WORLD is group:
            torch.distributed.destroy_process_group()


GROUP_AT_EXIT = GroupAtExit()
