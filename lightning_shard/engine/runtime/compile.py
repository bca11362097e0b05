"""torch.compile per unit: each unit's member modules get a compiled ``forward`` (torchtitan compiles each
transformer block the same way), and the engine's hooks stay outside the compiled regions.

Note: the compiled function is the module's ``forward``, not its ``__call__``: the unit's hooks run in
``nn.Module.__call__``, around it, in eager mode, so gathering, freeing and prefetching work as without
compile, and ``fullgraph=True`` holds inside a block. The gathered parameters are the same tensors at every
step (their storage is freed and re-gathered in place, flat_shard.py), so a compiled forward is traced once
per grad mode and dtype, not once per step. Where a user compiles more than a block (``torch.compile(model)``,
``block.compile()``), the hooks are reached from inside a compiled frame: they are dynamo-disabled (as hooks.py
installs them), so dynamo breaks the graph there and runs them eagerly instead of tracing collectives.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_shard.engine.storage.unit import Unit


def run_eagerly(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as dynamo must see it (disabled: a graph break, then run eagerly with nested frames left alone), at
    no cost in eager mode: ``torch.compiler.disable``'s own wrapper manages dynamo's frame callback at every call,
    some microseconds per hook, here per unit and step; ``is_compiling()`` is a constant True when dynamo traces."""
    disabled = torch.compiler.disable(hook)

    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)

    return call


_COMPILE_ARGS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def validate_compile(option: object) -> Optional[dict[str, Any]]:
    """``False``/``None`` (off), ``True`` (torch.compile's defaults) or a dict of torch.compile's keyword
    arguments (``{"mode": "max-autotune", "fullgraph": True}``); returns the keyword arguments or None."""
    if option is None or option is False:
        return None
    if option is True:
        return {}
    if isinstance(option, Mapping):
        unknown = [key for key in option if key not in _COMPILE_ARGS]
        if not unknown:
            return _plain(option)
        raise ValueError(f"`compile` got {unknown} which torch.compile does not take; its arguments are"
                         f" {', '.join(_COMPILE_ARGS)}.")
    raise ValueError("`compile` must be True, False, or a dict of torch.compile's keyword arguments (e.g."
                     f" {{'mode': 'max-autotune', 'fullgraph': True}}); got {option!r}.")


def _plain(value: Any) -> Any:
    """Mappings and sequences as dicts and lists all the way down: Hydra hands over DictConfig / ListConfig, which
    inductor's option checks do not take."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(item) for item in value]
    return value


def refuse_with_elision(compile_options: Optional[dict[str, Any]], elide_backward_gathers: bool) -> None:
    if compile_options is not None and elide_backward_gathers:
        raise ValueError(
            "`compile` and `elide_backward_gathers=True` do not go together: elision watches every op of a forward"
            " with a torch-function mode, which breaks a compiled block's graph at each op (and past torch's"
            " recompile limit runs it eagerly). Use one of them.")


def warn_if_compiled_by_user(root: nn.Module, elide_backward_gathers: bool) -> Optional[str]:
    """The same conflict, where the user compiled modules themselves (``block.compile()``, ``torch.compile``)."""
    compiled = [name for name, m in root.named_modules()
                if getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod")]
    if not (compiled and elide_backward_gathers):
        return None
    return (f"lightning_shard: {compiled[0]!r} is compiled and elide_backward_gathers=True: elision's torch-function"
            " mode breaks compiled graphs at each op, so compiled modules run little faster than eager (the numbers"
            " are the same). Leave elide_backward_gathers off with compiled modules.")


def compile_units(units: list[Unit], root_unit: Optional[Unit], options: dict[str, Any]) -> list[Callable[[], None]]:
    """Compile the ``forward`` of every member of every unit but the root (whose modules are the embeddings, the
    head and the loss around the blocks, called once each). Returns undo functions."""
    return [_compile_forward(member, options) for unit in units if unit is not root_unit for member in unit.members]


def _compile_forward(module: nn.Module, options: dict[str, Any]) -> Callable[[], None]:
    had_own = "forward" in module.__dict__  # a wrapper installed before (activation checkpointing)
    previous = module.forward
    module.forward = torch.compile(previous, **options)  # type: ignore[method-assign]

    def undo() -> None:
        if had_own:
            module.forward = previous  # type: ignore[method-assign]
        else:
            del module.forward

    return undo
