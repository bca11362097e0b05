"""Scenarios for test_host_step.py about what runs while offload's host is still stepping after ``optimizer.step()``
returned (engine/optim/host_step_deferred.py): the next forward behind the host, a collective inside that forward, the
host worker's own thread. Built on host_step_scenarios.py's fits (TinyGPT, compared with the serial offloaded fit bit
for bit)."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from tests.host_step_scenarios import GPT, SlowAdamW, _differ, fit
from tests.world import as_lightning_rank


class GatedAdamW(SlowAdamW):
    """SlowAdamW whose first two steps of a unit still to step after ``optimizer.step()`` returned, of the units the
    next forward gathers after those it prefetches at its start, wait until the next training step has begun
    (GatedGPT's opens them): where the host waits for such a unit before the next forward, the wait times out (5 s)
    and counts as ``held``."""

    cond = threading.Condition()
    stepper, gated, opened, counts = None, set(), [], {}  # (set by GatedGPT's training step, reset by the scenario)

    @torch.no_grad()
    def step(self, closure=None):
        gate = GatedAdamW
        armed = gate.stepper.deferred.in_flight if gate.stepper is not None else None
        mine = self.param_groups[0]["params"]
        if armed is not None and gate.counts["gated"] < 2 and any(id(p) in gate.gated for p in mine):
            with gate.cond:
                gate.counts["gated"] += 1
                if not gate.cond.wait_for(lambda: any(a is armed for a in gate.opened), timeout=5):
                    gate.counts["held"] += 1
        return super().step(closure)


class GatedGPT(GPT):
    """GPT stepped by GatedAdamW: its training step lets the units of the last step still stepping step now."""

    ELEMENTWISE = (GatedAdamW,)

    def training_step(self, batch, batch_idx):
        runtime = self.trainer.strategy.runtime
        later = [u for u in runtime.order if u is not runtime.root_unit][runtime.schedule.prefetch:]
        with GatedAdamW.cond:
            GatedAdamW.stepper = runtime.host_stepper
            GatedAdamW.gated = {id(p) for u in later for p in u.storage.shard_params}
            GatedAdamW.opened.append(runtime.host_stepper.deferred.in_flight)
            GatedAdamW.cond.notify_all()
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return GatedAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def forward_behind_the_host(rank: int, world: int, cases: dict[str, dict]) -> dict[str, dict]:
    """Per named case (fit options): how many unit steps still to come after optimizer.step() returned were held until
    the next training step began, and held back by the host (GatedAdamW); whether the fit gives the serial one's
    losses and parameters bit for bit."""
    as_lightning_rank(rank, world)
    report = {}
    for name, case in cases.items():
        runs = {}
        for overlap in (True, False):
            GatedAdamW.stepper, GatedAdamW.gated, GatedAdamW.opened = None, set(), []
            GatedAdamW.counts = {"gated": 0, "held": 0}
            runs[overlap] = {**fit(rank, world, "optimizer", overlap, "gated adamw", epochs=1, module=GatedGPT, **case),
                             **GatedAdamW.counts}
        overlapped, serial = runs[True], runs[False]
        report[name] = {"gated": overlapped["gated"], "held": overlapped["held"],
                        "same": overlapped["losses"] == serial["losses"] and not _differ(overlapped, serial)}
    return report


class SkewedAdamW(torch.optim.AdamW):
    """AdamW whose first two steps of the units in ``skewed`` take 0.5 s longer on rank 0 only (a host slower on one
    rank than on another; the same numbers)."""

    skewed: set = set()  # ids of those units' shard parameters (SyncedGPT's training step sets them)
    delayed = [0]

    @torch.no_grad()
    def step(self, closure=None):
        mine = self.param_groups[0]["params"]
        if dist.get_rank() == 0 and self.delayed[0] < 2 and any(id(p) in self.skewed for p in mine):
            self.delayed[0] += 1
            time.sleep(0.5)
        return super().step(closure)


class SyncedGPT(GPT):
    """GPT whose blocks agree across ranks inside their forward (an all-reduce, as SyncBatchNorm's statistics or an
    expert layer's all-to-all do), stepped by SkewedAdamW: rank 0's host is behind on the units after the first ones
    the next forward gathers."""

    ELEMENTWISE = (SkewedAdamW,)

    def __init__(self, optimizer: str, nonfinite_at: tuple[int, ...] = (), in_step: tuple[str, ...] = ()) -> None:
        super().__init__(optimizer, nonfinite_at, in_step)
        SkewedAdamW.skewed, SkewedAdamW.delayed = set(), [0]
        for block in self.model.blocks:
            block.register_forward_hook(lambda module, args, out: (dist.all_reduce(torch.ones(3)), out)[1])

    def training_step(self, batch, batch_idx):
        runtime = self.trainer.strategy.runtime
        later = [u for u in runtime.order if u is not runtime.root_unit][runtime.schedule.prefetch:]
        SkewedAdamW.skewed = {id(p) for u in later for p in u.storage.shard_params}
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return SkewedAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def collectives_of_the_worker(rank: int, world: int, case: dict) -> dict:
    """The overlapped fit (fit options ``case``) of an optimizer whose ``step`` calls its parent's, which torch has
    hooked (an AdamW built before in the process: torch wraps a class's ``step`` with the optimizer hooks at its first
    instance): the collectives its host worker thread issued, and whether it gives the serial fit's numbers."""
    as_lightning_rank(rank, world)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # (AdamW.step hooked, as after any AdamW in the process)
    off_main: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor", "broadcast")}

    def watched(name):
        def collective(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                off_main.append(name)
            return originals[name](*args, **kwargs)
        return collective

    for name in originals:
        setattr(dist, name, watched(name))
    try:
        overlapped = fit(rank, world, "optimizer", True, epochs=1, **case)
        serial = fit(rank, world, "optimizer", False, epochs=1, **case)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"off the main thread": sorted(set(off_main)), "overlapped": overlapped["overlapped"] > 0,
            "same": overlapped["losses"] == serial["losses"] and not _differ(overlapped, serial)}
