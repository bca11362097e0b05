"""Evaluation and generation with every unit held gathered: ``strategy.keep_gathered()`` and
``ShardStrategy(keep_gathered_in_eval=True)`` for the validation, test and predict loops."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Optional

from lightning_shard.engine.runtime.hooks import ShardRuntime


class EvaluationHold:
    """The hold of every unit through an evaluation loop (a part of ShardStrategy, whose loop hooks call it)."""

    def __init__(self) -> None:
        self._hold: Optional[ExitStack] = None  # the runtime's keep_gathered(), entered as a loop started

    def hold(self, runtime: Optional[ShardRuntime], in_eval: bool) -> None:
        """A loop starts (``in_eval``: the strategy's ``keep_gathered_in_eval``): every unit gathered until it ends."""
        if in_eval and runtime is not None and self._hold is None:
            hold = ExitStack()
            hold.enter_context(runtime.keep_gathered())
            self._hold = hold

    def release(self, exception: Optional[BaseException] = None) -> None:
        """The loop ended, or failed (``exception``)."""
        hold, self._hold = self._hold, None
        if hold is None:
            return
        if exception is None:  # every rank ends the loop: the check for writes (one tiny all-reduce) runs
            hold.close()
        else:  # maybe on this rank only: frees the gathered buffers, no collective
            hold.__exit__(type(exception), exception, exception.__traceback__)
