"""What the strategy says at setup about memory: the estimator's figures per rank, and a warning before the first
step when they already exceed what the rank's device has."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_shard.engine.optim.host_step import SPECULATIVE_SHARE
from lightning_shard.engine.runtime.hooks import ShardRuntime
from lightning_shard.memory.estimate import GradsHeld, MemoryEstimate, MiB, estimate_sharded


def report_memory_estimate(strategy: Any, trainer: "pl.Trainer") -> Optional[MemoryEstimate]:
    """Log the per-rank estimate of ``strategy``'s fit (activations excluded: they need a batch, see
    ``lightning_shard.memory.estimate``) and warn if it already exceeds what this rank's device has; the estimate,
    or None if it could not be made."""
    runtime: ShardRuntime = strategy.runtime
    optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in strategy.optimizers]
    device, local_ranks = strategy.root_device, strategy.num_processes
    held = GradsHeld(not strategy.frees_grads_after_step, trainer.accumulate_grad_batches,
                     strategy.reduce_during_accumulation)
    optimizer = _same_kind(optimizers[0]) if optimizers else torch.optim.SGD
    step = runtime.optimizers.step_of(optimizers[0]) if optimizers else None
    try:
        estimate = estimate_sharded(runtime, strategy.sharding, strategy.prefetch, optimizer,
                                    whole=step is not None and step.whole, step_group_numel=strategy.step_group_size,
                                    held=held, async_save=strategy.async_save)
    except Exception as err:  # an estimate must never stop training
        rank_zero_warn(f"lightning_shard: no memory estimate ({type(err).__name__}: {err}).")
        return None
    _add_averages(estimate, runtime, trainer.callbacks, device, strategy.async_save)
    clip = strategy.offload_overlap_clip
    if clip is not None and (clip[0] is not None or strategy.nonfinite is not None):
        # the overlapped host step's backups of the units it steps before clipping's norm is known (a bound)
        estimate.host_step += int(SPECULATIVE_SHARE * estimate.host_resident)
    peak, available = estimate.peak, _device_memory_per_rank(device, local_ranks)
    rank_zero_info(compact_report(estimate))
    rank_zero_debug("lightning_shard: estimated memory per rank before activations, every row (docs/memory.md):\n"
                    + estimate.table(omit=("activations",)))
    if available is not None and peak > available:
        rank_zero_warn(
            f"lightning_shard: the estimated {peak / 2**30:.2f} GiB per rank, before activations, exceeds the"
            f" {available / 2**30:.2f} GiB this rank's device has: expect out-of-memory. Shard over more ranks,"
            " use smaller units (unit_size), bf16, or activation_checkpointing."
        )
    host = _host_memory_per_rank(local_ranks)
    if estimate.host and host is not None and estimate.host > host:
        rank_zero_warn(
            f"lightning_shard: {estimate.host_uses} keep an estimated {estimate.host / 2**30:.2f} GiB per rank in host"
            f" memory, more than the {host / 2**30:.2f} GiB per rank this machine has: expect the host to run out of"
            " memory."
        )
    return estimate


def compact_report(estimate: MemoryEstimate, largest: int = 3) -> str:
    """The setup's default lines: the peak per rank before activations, its ``largest`` parts by the table's row
    names, and where the rest is."""
    parts = sorted(((k, v) for k, v in estimate.peak_parts().items() if v > 0), key=lambda kv: -kv[1])[:largest]
    host = f"; in host memory {estimate.host / MiB:.1f} MiB ({estimate.host_uses})" if estimate.host else ""
    return (f"lightning_shard: estimated peak per rank before activations {estimate.peak / MiB:.1f} MiB, most of it "
            + ", ".join(f"{name} {value / MiB:.1f}" for name, value in parts) + f" MiB{host}\n"
            "  every row: this log at DEBUG level, or python -m lightning_shard.estimate (which adds activations);"
            " what each row means: docs/memory.md")


def _add_averages(estimate: MemoryEstimate, runtime: ShardRuntime, callbacks: list, device: torch.device,
                  async_save: bool = False) -> None:
    """What callbacks keep beside the shards (``ShardedWeightAveraging``, ``ShardedEMA``: an average of the weights),
    on the device or in host memory, and saved in checkpoints (staged too under ``async_save``). Asked of each callback
    by its ``estimated_bytes`` rather than looked up by class: the averaging callbacks import the strategy, which
    imports this module."""
    for callback in callbacks:
        estimated_bytes = getattr(callback, "estimated_bytes", None)
        if callable(estimated_bytes):
            on_device, in_host = estimated_bytes(runtime, device)
            estimate.average += on_device
            estimate.host_resident += in_host
            if async_save:
                estimate.checkpoint_staging += on_device + in_host


def _same_kind(optimizer: Optimizer) -> Callable[[list], Optimizer]:
    """A factory of optimizers like ``optimizer`` (its constructor's own options), for the estimator's probe."""
    accepted = inspect.signature(type(optimizer)).parameters
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return lambda params: type(optimizer)(params, **options)


def _device_memory_per_rank(device: torch.device, local_ranks: int) -> Optional[int]:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _host_memory_per_rank(local_ranks)


def _host_memory_per_rank(local_ranks: int) -> Optional[int]:
    try:  # the ranks on one machine share its memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_ranks, 1)
    except (ValueError, OSError, AttributeError):
        return None
