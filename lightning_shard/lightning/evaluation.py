"""Evaluation and generation with every unit held gathered: ``strategy.keep_gathered()`` and
``ShardStrategy(keep_gathered_in_eval=True)`` for the validation, test and predict loops."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from typing import Optional

from lightning_shard.engine.runtime.hooks import ShardRuntime


class EvaluationHold:
    """Mixed into ShardStrategy (which sets ``runtime`` and ``keep_gathered_in_eval``)."""

    runtime: Optional[ShardRuntime]
    keep_gathered_in_eval: bool
    _eval_hold: Optional[ExitStack] = None

    @contextmanager
    def keep_gathered(self, modifier_rank: Optional[int] = None) -> Generator[None, None, None]:
        """Every unit held gathered inside (every rank must enter): forwards without gradients run no collective,
        so evaluation or generation needs one all-gather per unit in all, and ranks may generate different numbers
        of tokens. Costs ``strategy.runtime.held_bytes()`` per rank while it lasts. Writes to the parameters inside
        are written back from ``modifier_rank`` on exit, and refused without it (engine/runtime/held.py)."""
        assert self.runtime is not None, "keep_gathered before the model is sharded"
        with self.runtime.keep_gathered(modifier_rank):
            yield

    def _hold_for_eval(self) -> None:
        if self.keep_gathered_in_eval and self.runtime is not None and self._eval_hold is None:
            hold = ExitStack()
            hold.enter_context(self.runtime.keep_gathered())
            self._eval_hold = hold

    def _release_eval(self, exception: Optional[BaseException] = None) -> None:
        hold, self._eval_hold = self._eval_hold, None
        if hold is None:
            return
        if exception is None:  # every rank ends the loop: the check for writes (one tiny all-reduce) runs
            hold.close()
        else:  # maybe on this rank only: frees the gathered buffers, no collective
            hold.__exit__(type(exception), exception, exception.__traceback__)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._hold_for_eval()

    def on_validation_end(self) -> None:
        self._release_eval()
        super().on_validation_end()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._hold_for_eval()

    def on_test_end(self) -> None:
        self._release_eval()
        super().on_test_end()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._hold_for_eval()

    def on_predict_end(self) -> None:
        self._release_eval()
        super().on_predict_end()

    def on_exception(self, exception: BaseException) -> None:
        self._release_eval(exception)
        super().on_exception(exception)
