"""A unit's parameters reaching code outside the unit: returned from its forward, or read directly by another module.

Returned: Megatron's layers return ``(output, self.bias)`` for the caller to fuse: a copy is handed out instead
(engine/runtime/returned.py).

Read: a parent computing with ``self.linear1.weight`` after linear1 ran (freed), or ``self.linear2.weight`` before
linear2 runs (not gathered yet), would compute with a 1-D shard. DeepSpeed's ZeRO-3 gathers such "external parameters"
for the reader, seeing the read in each module's ``_parameters`` dict; so does the engine. Each module registering a
sharded parameter holds it in a :class:`TreeParameters` dict, of one of two classes, switched with the unit's state:
:class:`GatheredParameters` (plain dict lookups, while the unit is gathered) and :class:`ShardParameters`, whose lookup
(what ``module.weight`` does) calls the runtime, which gathers the unit where a step is running (ShardRuntime).

Either way the gradient of the unit's parameters may come from outside its own backward, after it: its reduction moves
to the end of backward. A unit read from outside is also kept gathered until then, since the reader's backward reads
what it saved of the gathered parameters (and kept allocated until the optimizer step or the next step, for a
``retain_graph`` backward through the reader).

The same dicts refuse to let a shard parameter be taken out of its module (``del module._parameters[name]``), which
is how torch.nn.utils.prune and ``parametrize.register_parametrization`` begin: the reparametrization would compute
with a 1-D shard.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


class TreeParameters(dict):
    """A module's ``_parameters`` under sharding; ``on_read(dict, key, value)`` answers a lookup while its unit holds
    shards (None: plain lookups)."""

    __slots__ = ("on_read",)

    def __delitem__(self, key: str) -> None:
        """A shard parameter taken out of its module (``del module.weight``: torch's pruning functions and
        ``parametrize.register_parametrization`` do, to reparametrize it between steps) would leave the module
        computing with whatever replaces it, never gathered: refused, naming it. (A gathered parameter, inside its
        unit's forward, may be: peft reparametrizes there.)"""
        value = dict.__getitem__(self, key)
        unit = self.on_read.owners.get(id(value)) if isinstance(self.on_read, OutsideReads) else None
        if unit is not None:
            name = next(s.names[0] for s, p in zip(unit.storage.slots, unit.storage.shard_params) if p is value)
            raise RuntimeError(
                f"lightning_shard: {name!r} is sharded; removing it from its module, as torch.nn.utils.prune's pruning"
                " functions and parametrize.register_parametrization do to reparametrize it, would leave the module"
                " computing with this rank's 1-D shard of it (a pruning mask computed from a shard, a threshold per"
                " rank). Prune or reparametrize before sharding (made permanent: `torch.nn.utils.prune.remove`), or"
                " the consolidated model after training (`python -m lightning_shard.consolidate`).")
        dict.__delitem__(self, key)


class GatheredParameters(TreeParameters):
    __slots__ = ()


class ShardParameters(TreeParameters):
    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        value = dict.__getitem__(self, key)
        on_read = self.on_read
        return value if on_read is None else on_read(self, key, value)


def adopt(module: nn.Module) -> TreeParameters:
    """``module``'s ``_parameters`` as a :class:`TreeParameters` (the same entries, in the same order), before any
    storage records where the parameters are registered."""
    parameters = module.__dict__["_parameters"]
    if not isinstance(parameters, TreeParameters):
        parameters = ShardParameters(parameters)
        parameters.on_read = None
        module.__dict__["_parameters"] = parameters
    return parameters


class OutsideReads:
    """The runtime's answer to a lookup of a shard parameter: the gathered parameter where ``gather(unit)`` gathered
    its unit (a step or a backward is running), else the shard parameter. Installed in every unit's dicts; a dict that
    holds one unit's parameters only has its class follow that unit's state (one holding several units', a tied weight
    beside a module's own, stays a :class:`ShardParameters`: the gathered ones pass through)."""

    def __init__(self, units: list, gather: Callable[[Any], bool]) -> None:
        self.owners = {id(param): unit for unit in units for param in unit.storage.shard_params}
        self.gather = gather
        self.trees = [list({id(d): d for d in unit.storage.trees}.values()) for unit in units]
        holders: dict[int, int] = {}
        for dicts in self.trees:
            for parameters in dicts:
                holders[id(parameters)] = holders.get(id(parameters), 0) + 1
                parameters.on_read = self
        for unit, dicts in zip(units, self.trees):
            unit.storage.sole_trees = [d for d in dicts if holders[id(d)] == 1]

    def __call__(self, parameters: TreeParameters, key: str, value: Any) -> Any:
        unit = self.owners.get(id(value))
        if unit is None or not self.gather(unit):
            return value
        return dict.__getitem__(parameters, key)

    def stop(self) -> None:
        """Plain lookups for good (the runtime's hooks are removed)."""
        for dicts in self.trees:
            for parameters in dicts:
                parameters.on_read = None
                parameters.__class__ = GatheredParameters
