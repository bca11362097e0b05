"""Lightning's model summary (``ModelSummary``, ``RichModelSummary``: on by default) counts ``p.numel()``, which for a
sharded model is this rank's shard: a 7B model on 8 ranks printed as 0.9B, frozen layers as 0. Its counts are read
here with the parameters in their full shapes, as DDP shows them."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary

from lightning_shard.engine.runtime.hooks import ShardRuntime


class _FullShapeCounts:
    """A Lightning summary whose attributes (the parameter counts, sizes and rows) are read while the module tree holds
    full-shape placeholders: the summary itself was made on the sharded model (its example-input forward runs)."""

    def __init__(self, summary: Any, runtime: ShardRuntime) -> None:
        self._summary, self._runtime = summary, runtime

    def __getattr__(self, name: str) -> Any:
        with self._runtime.shaped_parameters():
            value = getattr(self._summary, name)
        if not callable(value):
            return value

        def in_full_shapes(*args: Any, **kwargs: Any) -> Any:
            with self._runtime.shaped_parameters():
                return value(*args, **kwargs)

        return in_full_shapes


def summarize_in_full_shapes(callbacks: list) -> None:
    """Make the Trainer's model-summary callbacks count full parameters, under a sharding strategy (once per callback)."""
    for callback in callbacks:
        made = getattr(callback, "_summary", None)  # Lightning's private hook: left alone if it moved
        if isinstance(callback, ModelSummary) and made is not None and not hasattr(made, "in_full_shapes"):
            def summary(trainer: Any, pl_module: Any, made: Any = made) -> Any:
                runtime = getattr(trainer.strategy, "runtime", None)
                summarized = made(trainer, pl_module)
                return summarized if runtime is None else _FullShapeCounts(summarized, runtime)

            summary.in_full_shapes = True  # type: ignore[attr-defined]
            callback._summary = summary
