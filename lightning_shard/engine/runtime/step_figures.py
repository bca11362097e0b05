"""The last training step's communication figures, as ``ShardRuntime.last_step_stats`` gives them: one part per
optimizer step (manual optimization may step several per training step), each with what the device still knows of
its exposed time, summed when read."""

from __future__ import annotations

from typing import Any, Optional

from lightning_shard.engine.comm.collectives import CommStats


class StepFigures:
    def __init__(self, stats: CommStats, streams: Any) -> None:
        self.stats, self.streams = stats, streams
        self._parts: list[tuple[dict[str, float], Optional[list]]] = []
        self._total: Optional[dict[str, float]] = None
        self.forward_since_step = True  # a training forward ran since the last optimizer step

    def training_forward(self) -> None:
        """A forward with gradients began a step: the next optimizer step's figures start a new step's."""
        self.forward_since_step = True

    def close_part(self) -> None:
        """An optimizer step ran: its figures are a part of the step's (a new step's first, after a forward)."""
        if self.forward_since_step:  # else another optimizer of the same step (manual optimization)
            self._parts = []
        self._parts.append((self.stats.as_dict(), self.streams.close_step()))
        self.forward_since_step = False
        self._total = None
        self.stats.reset()

    @property
    def total(self) -> dict[str, float]:
        """On a GPU, ``exposed_seconds`` is the time the compute stream waited for the gather and reduce streams,
        measured by CUDA events (reading it waits for that step)."""
        if self._total is None:
            total: dict[str, float] = {}
            for stats, closed in self._parts:
                if closed is not None:
                    stats = {**stats, "exposed_seconds": self.streams.exposed_seconds(closed)}
                for key, value in stats.items():
                    total[key] = total.get(key, 0) + value
            self._total = total
        return self._total
