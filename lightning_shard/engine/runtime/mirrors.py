"""Frozen copies of trainable modules (a momentum teacher: MoCo, BYOL, DINO) whose parameters the units lay out
differently. Between steps the model holds 1-D shards, and an elementwise update of the copy from the original
(``t.mul_(m).add_(s, alpha=1 - m)``) pairs the shards element by element: where the two are laid out alike in their
units (the same unit structure, each parameter at the same offset) the pieces are the same elements on every rank,
and the update is exact; elsewhere (both in the root unit, or packed differently) they are other elements, of other
lengths (torch's shape error on some ranks, or a 1-element piece broadcast). Found at setup, said once."""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_shard.engine.storage.unit import Unit


def misaligned_mirrors(root: nn.Module, units: list[Unit], limit: int = 3) -> Optional[str]:
    """A warning naming the frozen copies of trainable modules laid out otherwise than their originals, or None."""
    layout = {}  # id(shard parameter) -> (its unit's shard size, its offset there), and its full shape
    for unit in units:
        for slot, shard in zip(unit.storage.slots, unit.storage.shard_params):
            layout[id(shard)] = (unit.storage.shard_numel, slot.offset), tuple(slot.shape), unit.members == [root]
    alike: dict[tuple, list[tuple[str, nn.Module]]] = {}
    for name, module in root.named_modules():
        params = list(module.named_parameters())
        if name and params and all(id(p) in layout for _, p in params):
            key = (type(module), tuple((n, layout[id(p)][1]) for n, p in params))
            alike.setdefault(key, []).append((name, module))
    found: list[tuple[str, str]] = []
    in_root = True  # every parameter laid out otherwise lies in the root unit (gathered for a whole step)
    for group in alike.values():
        for copy_name, copy in group:
            if any(p.requires_grad for p in copy.parameters()):
                continue
            for name, original in group:
                if original is copy or not any(p.requires_grad for p in original.parameters()):
                    continue
                if any(copy_name.startswith(f"{c}.") and name.startswith(f"{o}.") for c, o in found):
                    continue  # inside a pair named already
                apart = [(p, q) for p, q in zip(copy.parameters(), original.parameters())
                         if layout[id(p)][0] != layout[id(q)][0]]
                if apart:
                    found.append((copy_name, name))
                    in_root = in_root and all(layout[id(p)][2] and layout[id(q)][2] for p, q in apart)
    if not found:
        return None
    pairs = ", ".join(f"{c!r} of {o!r}" for c, o in found[:limit])
    return (f"lightning_shard: {pairs} {'is a frozen copy' if len(found) == 1 else 'are frozen copies'} laid out"
            " otherwise in the units: an elementwise update of the copy from the original between steps (a momentum"
            " teacher's `t.mul_(m).add_(s, alpha=1 - m)`) would pair other elements of each rank's 1-D shards. Give"
            " both units of the same layout (their class in `units=`)"
            + (", or update inside the training step (those parameters lie in the root unit, whole then)" if in_root
               else "") + "; a copy you never update from the original (a DPO reference model) needs nothing.")
