"""The processes and the process group of a ShardStrategy: launching, creating the default group (destroyed at
interpreter exit unless a run failed), the collectives Lightning asks a strategy for (logging, metrics,
decisions), and ending a stage without leaving a collective behind."""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerStatus
from torch import Tensor

from lightning_shard.engine.runtime.hooks import ShardRuntime


class ProcessGroup:
    """The processes and the default process group of a ShardStrategy (a part of it): how the other ranks are launched,
    the group created (with the strategy's ``timeout`` and backend), the collectives Lightning asks a strategy for, and
    a stage ended without a collective left behind."""

    def __init__(self, timeout: Optional[timedelta], backend: Optional[str]) -> None:
        self.timeout = timeout  # bound on every collective
        self.backend = backend  # None: the device's default, chosen as the group is created

    @staticmethod
    def launcher(cluster_environment: ClusterEnvironment, num_processes: int,
                 num_nodes: int) -> Optional[_SubprocessScriptLauncher]:
        """The launcher of the other ranks, where the environment does not create the processes itself."""
        if cluster_environment.creates_processes_externally:
            return None
        return _SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)

    def connect(self, cluster_environment: ClusterEnvironment, root_device: torch.device) -> None:
        """Create the default process group (destroyed at interpreter exit unless a run failed: GROUP_AT_EXIT), or join
        the one that exists."""
        self.backend = self.backend or _get_default_process_group_backend_for_device(root_device)
        kwargs: dict[str, Any] = {"timeout": self.timeout}
        if root_device.type != "cpu":
            kwargs["device_id"] = root_device
        creates_group = not _distributed_is_initialized()
        _init_dist_connection(cluster_environment, self.backend, **kwargs)
        if creates_group:
            GROUP_AT_EXIT.adopt(torch.distributed.group.WORLD)

    # -- collectives for Lightning (logging, metrics, decisions) ------------------------------------
    @staticmethod
    def barrier(root_device: Callable[[], torch.device]) -> None:
        """``root_device``: asked only under NCCL (a strategy without its devices yet may call it)."""
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[root_device().index])
        else:
            torch.distributed.barrier()

    @staticmethod
    def broadcast(obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    @staticmethod
    def reduce(tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- a stage's end ---------------------------------------------------------------------------------
    @staticmethod
    def end_stage(runtime: Optional[ShardRuntime], lightning_module: Any, barrier: Callable[[], None],
                  finish_saves: Callable[[], None]) -> None:
        """A stage (fit, validate, ...) ends: no collective left behind where it ended cleanly (async_save: a fit
        returns once its last save is complete, or raises); else none waited for."""
        trainer = getattr(lightning_module, "_trainer", None)
        if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED:
            _complete_inflight_gathers(runtime)
            finish_saves()  # (given back its staging memory too)
            barrier()  # no rank goes on to exit, closing its sockets, while another still communicates
        else:  # a peer may be dead or stuck in a collective: waiting on it, or destroying the group, could hang
            GROUP_AT_EXIT.failed = True


def _complete_inflight_gathers(runtime: Optional[ShardRuntime]) -> None:
    """Wait for prefetched all-gathers a stage left in flight (a step cut short): no collective may outlive the stage,
    since work still pending at exit is freed by a backend thread in interpreter shutdown."""
    if runtime is None:
        return
    runtime.wait_host_steps()  # offload's steps still to come after the last optimizer step (and their errors)
    for unit in runtime.units:
        if unit.inflight is not None:
            runtime.schedule.reshard(unit)  # waits for it, then frees its buffer


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
