"""The benchmark's probes: step timing between device synchronisations, the host time of chosen methods per step,
a profiler trace of chosen steps, and the host memory's peak over a run (``lightning_shard.tools.bench``)."""

from __future__ import annotations

import cProfile
import time
from typing import Any, Optional

import lightning as L
import torch


def sync(cuda: bool) -> None:
    if cuda:  # kernels run asynchronously: without this, host times measure launches, not work
        torch.cuda.synchronize()


class StepTimer(L.Callback):
    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.times: list[float] = []
        self.exposed: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        sync(self.cuda)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sync(self.cuda)
        self.times.append(time.perf_counter() - self._start)
        self.exposed.append(getattr(trainer.strategy, "comm_stats", {}).get("exposed_seconds", float("nan")))


class PhaseTimer(L.Callback):
    """Host seconds spent per step in chosen methods: ``phases`` maps a name to ``(class, method name)``, each method
    wrapped on its class for the rest of the process (a benchmark's own). Blocking calls (a CPU optimizer step, a wait
    for a device copy) take their real time; kernel launches only their issue."""

    def __init__(self, phases: dict[str, tuple[type, str]]) -> None:
        self.current = dict.fromkeys(phases, 0.0)
        self.steps: list[dict[str, float]] = []
        for name, (owner, attr) in phases.items():
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start

        return timed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(self.current)
        self.current = dict.fromkeys(self.current, 0.0)


class ProfileSteps(L.Callback):
    """Profiles ``count`` steps from batch ``first`` on: torch.profiler (written as a Chrome trace to ``trace`` if
    given), or cProfile with ``python``; ``wall`` is their time between device synchronisations."""

    def __init__(self, first: int, count: int, cuda: bool, trace: Optional[str] = None, python: bool = False) -> None:
        self.first, self.count, self.cuda, self.trace, self.python = first, count, cuda, trace, python
        self.profiler: Any = None
        self.wall = 0.0
        self._step: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.first:
            sync(self.cuda)
            if self.python:
                self.profiler = cProfile.Profile()
                self.profiler.enable()
            else:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
                self.profiler = profile(activities=activities)
                self.profiler.start()
            self._start = time.perf_counter()
        if self.profiler is not None and not self.python and self.first <= batch_idx < self.first + self.count:
            self._step = torch.profiler.record_function(f"train step {batch_idx}")
            self._step.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self.profiler is None or batch_idx != self.first + self.count - 1:
            return
        sync(self.cuda)
        self.wall = time.perf_counter() - self._start
        if self.python:
            self.profiler.disable()
        else:
            self.profiler.stop()
            if self.trace is not None:
                self.profiler.export_chrome_trace(self.trace)


class HostPeak:
    """The process's resident memory at its highest since :meth:`start`, above what it was then, in MiB (Linux:
    the kernel's high-water mark, reset through ``/proc/self/clear_refs``; nan elsewhere)."""

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = self._read("VmRSS")
        except OSError:
            self._base = float("nan")

    def growth_mb(self) -> float:
        try:
            return (self._read("VmHWM") - self._base) / 1024
        except OSError:
            return float("nan")

    @staticmethod
    def _read(field: str) -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])  # kB
        raise OSError(field)
