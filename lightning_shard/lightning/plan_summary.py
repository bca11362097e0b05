"""What a user reads at setup about the unit plan: a count and a short table by kind of unit (the full list,
one line per unit, at debug level)."""

from __future__ import annotations

from lightning_shard.engine.hooks import ShardRuntime
from lightning_shard.engine.unit import Unit


def _kind(unit: Unit) -> str:
    """Units of the same kind: same member classes (``<root>`` for the root unit)."""
    if unit.name == "<root>":
        return "<root>"
    return " + ".join(type(m).__name__ for m in unit.members)


def _numel(unit: Unit) -> int:
    return sum(slot.numel for slot in unit.storage.slots)


def _millions(numel: int) -> str:
    return f"{numel / 1e6:.2f}M" if numel >= 10_000 else f"{numel:,}"


def plan_summary(runtime: ShardRuntime, sharding: str, world_size: int) -> str:
    units = runtime.units
    total = sum(_numel(u) for u in units)
    kinds: dict[str, list[int]] = {}
    for unit in units:
        kinds.setdefault(_kind(unit), []).append(_numel(unit))
    rows = [(f"{len(sizes)} x {kind}", _millions(min(sizes)) if min(sizes) == max(sizes)
             else f"{_millions(min(sizes))} - {_millions(max(sizes))}") for kind, sizes in kinds.items()]
    width = max(len(name) for name, _ in rows)
    lines = [f"lightning_shard: sharding={sharding!r}, {len(units)} units over {world_size} ranks,"
             f" {_millions(total)} parameters"]
    lines += [f"  {name:<{width}}  {size} parameters each" for name, size in rows]
    return "\n".join(lines)


def plan_listing(runtime: ShardRuntime) -> str:
    return "\n".join(f"  {u.name}: {_numel(u):,} parameters" for u in runtime.units)
