"""How each optimizer is stepped under sharding, decided by its class (a documented registry, plus the user's
declarations). Two kinds:

* **elementwise**: the update of an element reads only that element's gradient and state (SGD, Adam, AdamW,
  ...). It steps this rank's 1-D shards where they lie: the fast path, optimizer state 1/N per rank.
* **whole**: the update of a parameter reads the whole parameter, in its shape, and nothing of the other
  parameters (Muon's orthogonalisation of each matrix, Adafactor's row and column moments and its RMS of the
  parameter, LAMB/LARS trust ratios). Each parameter gets one owner rank, which receives its full averaged
  gradient, steps it in its real shape, and sends the new values back to every rank's shards
  (``optimizer_step.py``). State lives on the owner only, so it is still 1/N in aggregate.

Anything else is refused at setup, naming how to declare it: stepping 1-D shards with an optimizer that is
not elementwise computes something else, silently. Refused outright: optimizers that re-evaluate the loss
inside ``step`` (LBFGS) or need sparse gradients (SparseAdam).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer

ELEMENTWISE = "elementwise"
WHOLE = "whole"

ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
)
# torch >= 2.5 has Adafactor, >= 2.9 Muon
WHOLE_PARAMETER_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    cls for cls in (getattr(torch.optim, "Muon", None), getattr(torch.optim, "Adafactor", None)) if cls is not None
)
REFUSED: dict[type[Optimizer], str] = {
    torch.optim.LBFGS: "it re-evaluates the loss several times inside one step and keeps one state for all"
                       " parameters together",
    torch.optim.SparseAdam: "it needs sparse gradients, and sharded gradients are dense",
}


def validate_optimizer_classes(option: str, classes: object) -> tuple[type, ...]:
    classes = tuple(classes) if isinstance(classes, Sequence) and not isinstance(classes, str) else classes
    if not isinstance(classes, tuple) or not all(isinstance(c, type) and issubclass(c, Optimizer) for c in classes):
        raise ValueError(f"`{option}` must be a list of torch.optim.Optimizer subclasses, got {classes!r}.")
    return classes


def optimizer_kind(optimizer: Optimizer, elementwise: Sequence[type] = (), whole: Sequence[type] = ()) -> str:
    """``"elementwise"`` or ``"whole"`` for ``optimizer``'s own class (not a base class: a subclass may change the
    update); the user's declarations first. Anything else is refused, saying how to declare it."""
    cls = type(optimizer)
    if cls in tuple(whole):
        return WHOLE
    if cls in tuple(elementwise):
        return ELEMENTWISE
    public = getattr(torch.optim, cls.__name__, None) is cls
    name = f"torch.optim.{cls.__name__}" if public else f"{cls.__module__}.{cls.__qualname__}"
    if cls in REFUSED:
        raise ValueError(f"lightning_shard: {name} cannot be sharded: {REFUSED[cls]}.")
    if cls in WHOLE_PARAMETER_OPTIMIZERS:
        return WHOLE
    if cls in ELEMENTWISE_OPTIMIZERS:
        return ELEMENTWISE
    known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    whole_known = ", ".join(c.__name__ for c in WHOLE_PARAMETER_OPTIMIZERS)
    raise ValueError(
        f"lightning_shard: {name} is not known to lightning_shard, so it cannot tell how to step it on sharded"
        f" parameters. Declare it: ShardStrategy(elementwise_optimizers=[{cls.__name__}]) if its update of each"
        f" element reads only that element's gradient and state (it then steps this rank's 1-D shards), or"
        f" ShardStrategy(matrix_optimizers=[{cls.__name__}]) if its update of a parameter reads that whole"
        f" parameter (its shape, norms, row/column statistics) and no other parameter (each parameter is then"
        f" stepped whole on one owner rank). Known elementwise: {known}; known whole-parameter: {whole_known}."
    )
