"""Which optimizers can step 1-D shards: those whose update of an element reads only that element's
gradient and state (elementwise). Any other optimizer (Adafactor's factored moments, LAMB/LARS trust
ratios, Muon's orthogonalisation, LBFGS's line search) would silently compute something else on a shard,
so it is refused until owner-based steps land (issue 15), unless the user declares their own class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer

ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
)


def validate_elementwise_optimizers(classes: object) -> tuple[type, ...]:
    classes = tuple(classes) if isinstance(classes, Sequence) and not isinstance(classes, str) else classes
    if not isinstance(classes, tuple) or not all(isinstance(c, type) and issubclass(c, Optimizer) for c in classes):
        raise ValueError(f"`elementwise_optimizers` must be a list of torch.optim.Optimizer subclasses, got {classes!r}.")
    return classes


def check_optimizer(optimizer: Optimizer, declared: Sequence[type] = ()) -> None:
    """Refuse an optimizer whose step is not known to be elementwise (its own class decides, not a base)."""
    cls = type(optimizer)
    if cls in ELEMENTWISE_OPTIMIZERS or cls in tuple(declared):
        return
    known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"lightning_shard: {cls.__module__}.{cls.__qualname__} is not known to update parameters elementwise, and"
        f" under sharding it would step 1-D shards of each parameter. Supported: {known}. If its update of each"
        f" element reads only that element's gradient and state, declare it with"
        f" ShardStrategy(elementwise_optimizers=[{cls.__name__}]); matrix optimizers (Muon, Adafactor, LAMB,"
        f" LBFGS) are not supported yet."
    )
