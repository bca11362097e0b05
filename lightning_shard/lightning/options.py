"""Checks of ShardStrategy's plain options at construction, each error naming the option and what it accepts
(the engine's own options are checked by the engine's validators)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional, Union

from lightning_shard.engine.optim.optimizers import validate_optimizer_classes


def check_flag(option: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{option}` must be True or False, got {value!r}.")
    return value


def check_count(option: str, value: object, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{option}` must be an int >= {minimum} ({meaning}), got {value!r}.")
    return value


def check_nonfinite(value: object) -> Optional[str]:
    if value not in (None, "skip", "error"):
        raise ValueError(f"`nonfinite` must be None, 'skip' or 'error'; got {value!r}.")
    return value  # type: ignore[return-value]


def check_timeout(value: Any) -> Optional[timedelta]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if value is not None and not isinstance(value, timedelta):
        raise ValueError(f"`timeout` must be a timedelta or a number of seconds, got {value!r}.")
    return value


def check_declared_optimizers(elementwise: Sequence[type], matrix: Sequence[type]) -> tuple[tuple, tuple]:
    elementwise = validate_optimizer_classes("elementwise_optimizers", elementwise)
    matrix = validate_optimizer_classes("matrix_optimizers", matrix)
    both = set(elementwise) & set(matrix)
    if both:
        raise ValueError(f"{sorted(c.__name__ for c in both)} declared both in `elementwise_optimizers` and in"
                         " `matrix_optimizers`: an optimizer is one or the other.")
    return elementwise, matrix


def check_units_or_size(units: Union[None, tuple], unit_size: Optional[int]) -> None:
    if units is not None and unit_size is not None:
        raise ValueError("Give either `units` (module classes) or `unit_size` (a parameter budget), not both.")
