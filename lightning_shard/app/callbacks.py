"""RunSummary: one JSON per run with what a unit-size sweep compares (time, memory, bytes, loss).

Ours, not Lightning's ``ThroughputMonitor``: that logs rolling throughput through a logger; a sweep compares
each run's median step time after warm-up, peak memory and bytes moved, read back from one file per run.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from typing import Any, Optional

import lightning as L
import torch


def model_state_bytes(module: torch.nn.Module, optimizers: list) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards only; a DTensor
    counts its local part). A gradient per trainable parameter, as at the optimizer step, whether or not it was
    freed since (``ShardStrategy(free_grads_after_step=True)``)."""
    tensors = [p for p in module.parameters()] + [p for p in module.parameters() if p.requires_grad]
    tensors += [v for opt in optimizers for s in opt.state.values() for k, v in s.items()
                if torch.is_tensor(v) and k != "step"]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


class RunSummary(L.Callback):
    def __init__(self, path: str, warmup_steps: int = 5) -> None:
        self.path, self.warmup_steps = path, warmup_steps
        self.step_times: list[float] = []
        self.bytes_moved: Optional[float] = None
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.step_times.append(time.perf_counter() - self._start)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        runtime = getattr(strategy, "runtime", None)
        comm = dict(getattr(strategy, "comm_stats", {}))
        timed = self.step_times[self.warmup_steps :] or self.step_times
        estimate = getattr(strategy, "memory_estimate", None)
        summary = {
            "sharding": getattr(strategy, "sharding", type(strategy).__name__),
            "unit_size": getattr(strategy, "unit_size", None),
            "units": len(runtime.units) if runtime is not None else None,
            "world_size": trainer.world_size,
            "precision": trainer.precision,
            "steps": trainer.global_step,
            "median_step_s": statistics.median(timed) if timed else None,
            # the spread, for the sweep plot: a difference between medians smaller than this is noise
            "q1_step_s": _quartiles(timed)[0],
            "q3_step_s": _quartiles(timed)[1],
            "model_state_mb_per_rank": model_state_bytes(pl_module, trainer.optimizers) / 2**20,
            # estimated at setup, activations excluded (python -m lightning_shard.estimate includes them)
            "estimated_mb_per_rank": estimate.peak / 2**20 if estimate is not None else None,
            "estimated_host_mb_per_rank": estimate.host / 2**20 if estimate is not None and estimate.host else None,
            "estimated_host_uses": estimate.host_uses if estimate is not None and estimate.host else None,
            "cuda_peak_mb_per_rank": (torch.cuda.max_memory_allocated(strategy.root_device) / 2**20
                                      if strategy.root_device.type == "cuda" else None),
            "peak_gathered_mb_per_rank": runtime.schedule.peak_gathered_bytes / 2**20 if runtime is not None else None,
            "peak_rss_mb_per_rank": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "bytes_moved_mb_per_step": _moved_mb(comm) if comm else None,
            "final_train_loss": _metric(trainer, "train_loss"),
            "final_val_loss": _metric(trainer, "val_loss"),
        }
        self._write(trainer, summary)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Add the test metrics (and, where the data offers one, the majority-class baseline)."""
        if not trainer.is_global_zero or not os.path.exists(self.path):  # other ranks read it while rank 0 wrote
            return
        with open(self.path) as f:
            summary = json.load(f)
        summary.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test_")})
        baseline = getattr(trainer.datamodule, "majority_baseline", None)
        if callable(baseline):
            summary["test_majority_baseline"] = baseline("test")
        self._write(trainer, summary)

    def _write(self, trainer: L.Trainer, summary: dict) -> None:
        if trainer.is_global_zero:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            partial = self.path + ".partial"  # renamed when complete: a reader never sees half a file
            with open(partial, "w") as f:
                json.dump(summary, f, indent=2)
            os.replace(partial, self.path)


def _quartiles(times: list[float]) -> tuple[Optional[float], Optional[float]]:
    if len(times) < 2:
        return (times[0], times[0]) if times else (None, None)
    q1, _, q3 = statistics.quantiles(times, n=4)
    return q1, q3


def _metric(trainer: L.Trainer, name: str) -> Optional[float]:
    value = trainer.callback_metrics.get(name)
    return float(value) if value is not None else None


class PrintProgress(L.Callback):
    """Prints the training loss every ``every`` steps and each validation loss (rank 0 only).

    Ours, not Lightning's progress bar (tqdm or rich), which does draw from a spawned rank 0: the bar keeps
    only its last state where output is not a terminal (a log file, CI, a sweep), so the loss history is
    lost; validation metrics and the bytes moved per step are not in it; and it counts epochs in a run
    measured in steps ("Epoch 0/-2").
    """

    def __init__(self, every: int = 10) -> None:
        self.every = every

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step == 1 or step % self.every == 0) and "train_loss" in trainer.callback_metrics:
            comm = getattr(trainer.strategy, "comm_stats", {})
            moved = _moved_mb(comm)
            print(f"step {step:5d}  train_loss {float(trainer.callback_metrics['train_loss']):.4f}"
                  f"  moved {moved:.1f} MB/step", flush=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            shown = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
            print(f"step {trainer.global_step:5d}  {shown}", flush=True)


def _moved_mb(comm: dict[str, float]) -> float:
    """MB moved by the last step's collectives: within shard groups and across replicas."""
    return (comm.get("in_group_bytes", 0) + comm.get("cross_group_bytes", 0) + comm.get("all_reduce_bytes", 0)) / 2**20
