"""An optimizer's parameter groups, the same on every rank.

Between steps an optimizer holds this rank's 1-D shards, so code that compares parameters by value compares
shards: a shard of zeros equals any other of its length, and every empty shard equals every other one. A
callback that leaves out the parameters "already in the optimizer" by value (as Lightning's
``BaseFinetuning.filter_on_optimizer`` does; under ShardStrategy that one compares identities, see
``lightning/finetuning.py``) can then build different groups on different ranks, and a rank that steps a
parameter the others do not (or owns one they never send) trains something else, silently.

So whatever reads an optimizer's groups across ranks (its step, clipping, the gradient scaler, checkpoints) first
agrees on them: one tiny all-reduce of a fingerprint (per group, its parameters by name and its options). When
the ranks differ, they exchange their groups and every rank takes the union:

* a parameter that some ranks hold in a group and another rank holds in none is added to that rank's group,
  when that rank's shard of it equals (``torch.equal``) a tensor its optimizer holds: what a value comparison
  drops; a group that such a rank lacks altogether is added with the options the other ranks gave it;
* anything else is a real difference, an error on every rank naming the parameter and the rank: a parameter
  one rank added whose shard equals nothing there, a parameter in different groups, different options, groups
  whose order cannot be told.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_shard.engine.comm import collectives
from lightning_shard.engine.comm.collectives import CommStats

_COMPARED = (bool, int, float, str, type(None))  # options compared across ranks (a tensor `lr` is not)


@dataclass
class GroupView:
    """One param group as a rank describes it to the others."""

    options: dict[str, Any]  # everything but "params"; tensors on the CPU
    names: list[str]  # the model's parameters it holds, by name
    foreign: int = 0  # tensors that are not the model's (stepped as they are on every rank)
    ranks: list[int] = field(default_factory=list)  # who holds this group (filled by merge_groups)


def describe(optimizer: Optimizer, names: Mapping[int, str]) -> list[GroupView]:
    """``names``: id(shard parameter) -> parameter name."""
    views = []
    for group in optimizer.param_groups:
        held = [names.get(id(p)) for p in group["params"]]
        options = {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in group.items() if k != "params"}
        views.append(GroupView(options, [n for n in held if n is not None], sum(n is None for n in held)))
    return views


def fingerprint(optimizer: Optimizer, index: Mapping[int, int], cache: Optional[list] = None) -> int:
    """What ranks compare each step: per group its parameters (``index``: id(shard parameter) -> position in
    the model, unordered within a group), its number of other tensors and its compared options. ``cache``: a list
    the caller keeps, holding the membership part for the groups' current parameters (it rarely changes)."""
    key = tuple(tuple(map(id, group["params"])) for group in optimizer.param_groups)
    if cache and cache[0] == key:
        membership = cache[1]
    else:
        membership = []
        for group in optimizer.param_groups:
            held = [index.get(id(p), -1) for p in group["params"]]
            membership.append(collectives.fingerprint([*sorted(i for i in held if i >= 0), -2, held.count(-1)]))
        if cache is not None:
            cache[:] = [key, membership]
    options = [_options_hash(group) for group in optimizer.param_groups]
    return collectives.fingerprint([v for pair in zip(membership, options) for v in (-1, *pair)])


def _compared(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != "params" and _comparable(v)}


def _comparable(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_comparable(v) for v in value)
    return isinstance(value, _COMPARED)


def _options_hash(options: Mapping[str, Any]) -> int:
    # crc32 of the repr, not hash(): str hashes differ between processes
    return zlib.crc32(repr(sorted(_compared(options).items())).encode())


class GroupMismatch(RuntimeError):
    """The ranks' optimizers hold different groups, in a way sharding cannot explain."""


def merge_groups(views: list[list[GroupView]], optimizer_name: str) -> list[GroupView]:
    """The union of every rank's groups (``views[rank]``), in the ranks' common order; each merged group lists the
    ranks that hold it. Raises :class:`GroupMismatch` for what a rank's missing parameters cannot explain."""
    widest = max(range(len(views)), key=lambda r: (sum(len(g.names) for g in views[r]), -r))
    merged = [GroupView(dict(g.options), list(g.names), g.foreign, [widest]) for g in views[widest]]
    for rank, groups in enumerate(views):
        if rank == widest:
            continue
        position = 0  # the rank's groups map to merged groups in increasing order
        for i, group in enumerate(groups):
            found = {k for k, m in enumerate(merged) if set(m.names) & set(group.names)}
            if len(found) > 1:
                a, b = (next(n for n in group.names if n in merged[k].names) for k in sorted(found)[:2])
                raise GroupMismatch(f"lightning_shard: ranks' {optimizer_name} optimizers hold {a!r} and {b!r} in one"
                                    f" param group on rank {rank} (its group {i}) and in different groups on other"
                                    " ranks. Build the optimizer, and add parameter groups, the same way on every rank.")
            if found:
                k = found.pop()
            elif (not group.names and position < len(merged) and not merged[position].names
                  and rank not in merged[position].ranks and _same_options(merged[position], group)):
                k = position  # groups holding none of the model's parameters: matched by place
            elif position < len(merged) and rank not in merged[position].ranks:
                raise GroupMismatch(f"lightning_shard: ranks' {optimizer_name} optimizers each lack a param group the"
                                    f" others hold (rank {rank}'s group {i}, and group {position} of rank"
                                    f" {merged[position].ranks[0]}), so their order cannot be told. Build the"
                                    " optimizer, and add parameter groups, the same way on every rank.")
            else:  # a group no rank merged so far holds, before the next one this rank holds
                merged.insert(position, GroupView(dict(group.options), [], group.foreign))
                k = position
            if k < position:
                raise GroupMismatch(f"lightning_shard: ranks' {optimizer_name} optimizers hold their param groups in"
                                    f" different orders (rank {rank}'s group {i}). Add parameter groups in the same"
                                    " order on every rank.")
            target = merged[k]
            if not _same_options(target, group):
                differ = sorted(key for key in set(_compared(target.options)) | set(_compared(group.options))
                                if target.options.get(key) != group.options.get(key))
                values = ", ".join(f"{key}={group.options.get(key)!r} on rank {rank} and"
                                   f" {target.options.get(key)!r} on rank {target.ranks[0]}" for key in differ)
                raise GroupMismatch(f"lightning_shard: ranks' {optimizer_name} optimizers give param group {k} other"
                                    f" options: {values}. Set group options the same way on every rank.")
            if target.foreign != group.foreign:
                raise GroupMismatch(f"lightning_shard: ranks' {optimizer_name} optimizers hold different numbers of"
                                    f" tensors that are not the model's parameters in param group {k} ({group.foreign}"
                                    f" on rank {rank}, {target.foreign} on rank {target.ranks[0]}).")
            target.names += [n for n in group.names if n not in target.names]
            target.ranks.append(rank)
            position = k + 1
    return merged


def _same_options(a: GroupView, b: GroupView) -> bool:
    return _compared(a.options) == _compared(b.options)


def unexplained(optimizer: Optimizer, merged: list[GroupView], shards: Mapping[str, Tensor]) -> list[str]:
    """The merged groups' parameters this rank's optimizer lacks and that no value comparison can have dropped:
    their shard here equals no tensor the optimizer holds. ``shards``: name -> this rank's shard parameter."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    have = {id(p) for p in held}
    missing = [name for group in merged for name in group.names if id(shards[name]) not in have]
    return [name for name in missing if not any(_equal(shards[name], p) for p in held)]


def _equal(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def adopt(optimizer: Optimizer, merged: list[GroupView], rank: int, shards: Mapping[str, Tensor]) -> None:
    """Make ``optimizer``'s param groups the merged ones, in place: a group this rank holds keeps its options and
    its other tensors; one it lacks comes with the options another rank gave it."""
    own = {id(p) for p in shards.values()}
    groups = iter(optimizer.param_groups)
    device = next(iter(shards.values())).device if shards else torch.device("cpu")
    result = []
    for view in merged:
        if rank in view.ranks:
            group = next(groups)
            held = [p for p in group["params"] if id(p) in own]
            if {id(p) for p in held} != {id(shards[n]) for n in view.names}:
                group["params"] = [shards[n] for n in view.names] + [p for p in group["params"] if id(p) not in own]
        else:
            options = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in view.options.items()}
            group = {**options, "params": [shards[n] for n in view.names]}
        result.append(group)
    optimizer.param_groups[:] = result


def agree_on_groups(optimizer: Optimizer, index: Mapping[int, int], names: Mapping[int, str],
                    shards: Mapping[str, Tensor], group: Optional[dist.ProcessGroup], stats: CommStats,
                    cache: Optional[list] = None) -> bool:
    """Every rank's ``optimizer`` holds the same groups afterwards (or every rank raised the same error); whether
    they had to be merged. Every rank must call it. ``index``/``names``: id(shard parameter) -> position / name
    in the model; ``shards``: name -> shard parameter."""
    value = fingerprint(optimizer, index, cache)
    high, low = collectives.agree(torch.tensor([value, -value]), group, stats,  # a host value, over the host group
                                  label="agreement on the optimizer's parameter groups").tolist()
    if high == -low:
        return False
    label = "exchange of the optimizers' parameter groups"
    cls = type(optimizer).__name__
    merged = merge_groups(collectives.from_every_rank(describe(optimizer, names), group, stats, label), cls)
    lacking = collectives.from_every_rank(unexplained(optimizer, merged, shards), group, stats, label)
    for rank, missing in enumerate(lacking):  # the same lists on every rank: every rank raises the same error
        if missing:
            holders = next(g.ranks for g in merged if missing[0] in g.names)
            raise GroupMismatch(
                f"lightning_shard: ranks' {cls} optimizers hold different parameters: {missing[:4]} are in a param"
                f" group on ranks {sorted(holders)} and in none on rank {rank}, where no value comparison can have"
                " dropped them (its shard there equals no tensor its optimizer holds, unlike what Lightning's"
                " BaseFinetuning.filter_on_optimizer drops). Build the optimizer, and add parameter groups, the same"
                " way on every rank.")
    adopt(optimizer, merged, dist.get_rank(group), shards)
    return True
