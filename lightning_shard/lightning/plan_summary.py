"""What a user reads at setup about the unit plan: a count and a short table by kind of unit (the full list,
one line per unit, at debug level)."""

from __future__ import annotations

from lightning_shard.engine.runtime.hooks import ShardRuntime
from lightning_shard.engine.storage.unit import Unit


def _kind(unit: Unit) -> str:
    """Units of the same kind: same member classes (``<root>`` for the root unit)."""
    if unit.name == "<root>":
        return "<root>"
    counts: dict[str, int] = {}
    for member in unit.members:  # unit_size packs several siblings into one unit
        counts[type(member).__name__] = counts.get(type(member).__name__, 0) + 1
    kind = " + ".join(f"{n} {cls}" if n > 1 else cls for cls, n in counts.items())
    return f"[{kind}]" if len(unit.members) > 1 else kind


def _numel(unit: Unit) -> int:
    """Its parameters' elements: a 4-bit weight's before packing, its quantization state not counted."""
    return sum(slot.quant.shape.numel() if getattr(slot, "quant", None) is not None else slot.numel
               for slot in unit.storage.slots if slot.locations)


def _count(numel: int, millions: bool) -> str:
    return f"{numel / 1e6:.2f}M" if millions else f"{numel:,}"


def plan_summary(runtime: ShardRuntime, sharding: str, world_size: int) -> str:
    units = runtime.units
    total = sum(_numel(u) for u in units)
    kinds: dict[str, list[int]] = {}
    for unit in units:
        kinds.setdefault(_kind(unit), []).append(_numel(unit))
    rows = []
    for kind, sizes in kinds.items():
        millions = max(sizes) >= 10_000
        low, high = _count(min(sizes), millions), _count(max(sizes), millions)
        size = low if low == high else f"{low} - {high}"
        rows.append((f"{len(sizes)} x {kind}", f"{size} parameters{' each' if len(sizes) > 1 else ''}"))
    width = max(len(name) for name, _ in rows)
    compiled = getattr(runtime, "options", {}).get("compile")  # None: off; {}: torch.compile's defaults
    how = "" if compiled is None else f", blocks compiled (torch.compile{f'(**{compiled!r})' if compiled else ''})"
    groups = runtime.groups
    if sharding == "hybrid":
        sharding = f"{sharding!r} (shard groups of {groups.shard_size} ranks, {groups.replicas} replicas)"
    else:
        sharding = repr(sharding)
    lines = [f"lightning_shard: sharding={sharding}, {len(units)} units over {world_size} ranks,"
             f" {_count(total, total >= 10_000)} parameters{how}"]
    lines += [f"  {name:<{width}}  {size}" for name, size in rows]
    return "\n".join(lines)


def plan_listing(runtime: ShardRuntime) -> str:
    return "\n".join(f"  {u.name}: {_numel(u):,} parameters" for u in runtime.units)
