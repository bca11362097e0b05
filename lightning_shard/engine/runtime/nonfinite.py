"""What a non-finite gradient does (``nonfinite``): before an optimizer step (optim/step_watch.py) the ranks agree
whether any gradient shard is not finite (a non-finite loss makes them so), and skip the step together (``"skip"``:
the optimizer sees no gradient) or stop (``"error"``)."""

from __future__ import annotations

import warnings
from typing import Optional

from lightning_shard.engine.runtime.reduce import GradientReducer
from lightning_shard.engine.runtime.step_state import StepState
from lightning_shard.engine.storage.unit import Unit


class NonfinitePolicy:
    def __init__(self, mode: Optional[str], units: list[Unit], reducer: GradientReducer, state: StepState) -> None:
        self.mode = mode  # None, "skip" or "error"
        self.units = units
        self.reducer = reducer  # (which agrees on the first unit with a non-finite gradient shard)
        self.state = state  # (its steps done, named in the warning)
        self.skipped_steps = 0

    def apply(self) -> None:
        """Every rank, before an optimizer step (``mode`` set): skip it on every rank, or raise, where any gradient
        shard is not finite on any rank."""
        first = self.reducer.first_nonfinite()
        if first is None:
            return
        if self.mode == "error":
            raise FloatingPointError(
                f"lightning_shard: non-finite gradient at step {self.state.steps_done}, first in unit {first.name!r}."
            )
        for unit in self.units:  # "skip": the optimizer sees no gradient anywhere, on every rank
            unit.storage.clear_grads()
        self.skipped_steps += 1
        warnings.warn(f"lightning_shard: step {self.state.steps_done} skipped: non-finite gradient in unit"
                      f" {first.name!r}.")
