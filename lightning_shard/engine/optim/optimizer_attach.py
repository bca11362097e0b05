"""Optimizers of a sharded model: built against the parameters' real shapes, then attached to the shards.

Between steps the model's parameters are 1-D shards, and an optimizer built from them would see the wrong
shapes: ``torch.optim.Muon`` refuses them, and the common ``p.ndim >= 2`` rule for weight decay (nanoGPT,
torch's Muon docs) would silently put every parameter in the no-decay group. So the optimizer is built inside
:meth:`OptimizerAttachment.shaped_parameters`, where the tree holds full-shape placeholders (meta tensors with
each parameter's name, shape, dtype and ``requires_grad``), and :meth:`OptimizerAttachment.attach` then puts
the shard parameters in their place and prepares its sharded step (``optimizer_step.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.engine.comm.collectives import CommStats
from lightning_shard.engine.comm.groups import ShardGroups
from lightning_shard.engine.optim.fused_default import FusedWhereUnchosen, fused_by_default
from lightning_shard.engine.optim.host_optimizer import prepare_host_step
from lightning_shard.engine.optim.norms import check_norm_type
from lightning_shard.engine.optim.optimizer_step import DEFAULT_STEP_GROUP_NUMEL, ShardedStep, refuse_foreign
from lightning_shard.engine.storage.unit import Unit


class OptimizerAttachment:
    def __init__(self, units: list[Unit], groups: ShardGroups, stats: CommStats, root: nn.Module,
                 host_stepper: Any = None, before_step: Optional[Callable[[], None]] = None) -> None:
        self.units = units
        self.root = root
        self.host_stepper = host_stepper  # offload's overlapped step, given to each optimizer's step
        self.groups = groups
        self.group = groups.shard  # owners' exchanges; the world agrees on the param groups
        self.world = groups.shard_size
        self.stats = stats
        self._placeholders: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (placeholder, shard)
        self.before_step = before_step  # each sharded step's check that the gradients are whole

    @contextmanager
    def shaped_parameters(self) -> Iterator[None]:
        """Inside, ``model.parameters()`` / ``named_parameters()`` give full-shape placeholders on the meta
        device: build optimizers there, then :meth:`attach` them."""
        held, self._placeholders = [], {}
        for unit in self.units:
            storage = unit.storage
            for slot, shard in zip(storage.slots, storage.shard_params):
                placeholder = nn.Parameter(shard.new_empty(slot.shape, device="meta"), requires_grad=shard.requires_grad)
                self._placeholders[id(placeholder)] = (placeholder, shard)
                for module, attr in slot.locations:
                    held.append((module, attr, module._parameters[attr]))
                    module._parameters[attr] = placeholder
        try:
            yield
        finally:
            for module, attr, param in reversed(held):
                module._parameters[attr] = param

    def attach(self, optimizer: Optimizer, whole: bool = False,
               step_group_numel: int = DEFAULT_STEP_GROUP_NUMEL) -> ShardedStep:
        """Replace the placeholders ``optimizer`` holds by the shard parameters, and return its sharded step
        (``whole``: the optimizer steps whole parameters, each on its owner rank)."""
        built = [p for p in optimizer.state if self._is_placeholder(p)]
        if built and type(optimizer) is not torch.optim.Adagrad:
            cls = type(optimizer).__name__
            raise ValueError(f"lightning_shard: {cls} created optimizer state when it was built; it cannot be"
                             " sharded. Build its state in `step` (as torch's optimizers but Adagrad do).")
        for param in built:  # (meta tensors of the full shapes)
            del optimizer.state[param]
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                if self._is_placeholder(param):
                    params[i] = self._placeholders[id(param)][1]  # in place: the optimizer may hold the list
        if built:  # torch's Adagrad builds its accumulators in __init__ (from its own argument): built again, sharded
            again = torch.optim.Adagrad([dict(group) for group in optimizer.param_groups],
                                        initial_accumulator_value=optimizer.defaults["initial_accumulator_value"])
            optimizer.state.update(again.state)
        if any(unit.storage.offloaded for unit in self.units):  # stepped on the CPU
            fused = prepare_host_step(optimizer)
        else:
            first = self.units[0].storage if self.units else None
            fused = (first is not None and not whole
                     and fused_by_default(type(optimizer), first.shard.device, first.master_dtype))
        where = {id(shard): (u, unit.storage, s) for u, unit in enumerate(self.units)
                 for s, shard in enumerate(unit.storage.shard_params)}
        refuse_foreign(optimizer, where, self._describe)
        step = ShardedStep(optimizer, whole, where, self.groups, self.stats, step_group_numel)
        step.describe = self._describe
        step.fused = FusedWhereUnchosen(optimizer) if fused else None
        step.before_step = self.before_step
        step.host_stepper = self.host_stepper
        if self.host_stepper is not None:  # its state, read or loaded, after the steps still to come
            optimizer.register_state_dict_pre_hook(lambda _: self.host_stepper.finish())
            optimizer.register_load_state_dict_pre_hook(lambda *_: self.host_stepper.finish())
        optimizer._shard_step = step  # kept by the optimizer: it lives as long as the optimizer
        return step

    @staticmethod
    def step_of(optimizer: Optimizer) -> Optional[ShardedStep]:
        return getattr(optimizer, "_shard_step", None)

    def agree_on_groups(self, optimizer: Optimizer) -> None:
        """The ranks' param groups made the same (every rank must call it): checkpoints do, before they save
        or load what the groups hold."""
        step = self.step_of(getattr(optimizer, "_optimizer", optimizer))  # a LightningOptimizer's own
        if step is not None:
            step.agree_on_groups()

    def whole_states(self, optimizer: Optimizer) -> Optional[bool]:
        """None for an elementwise optimizer (each rank holds its shards' state); for a whole-parameter one,
        whether its states are spread over owner ranks (True) or held whole by every rank (False)."""
        step = self.step_of(optimizer)
        if step is None or not step.whole:
            return None
        return any(step.owner(p) is not None for group in optimizer.param_groups for p in group["params"])

    def holds_state(self, optimizer: Optimizer, param: nn.Parameter) -> bool:
        """Whether this rank holds ``param``'s optimizer state: its owner, or every rank."""
        step = self.step_of(optimizer)
        owner = step.owner(param) if step is not None else None
        return owner is None or owner == (dist.get_rank(self.group) if self.world > 1 else 0)

    @contextmanager
    def stepping(self, optimizer: Optimizer) -> Iterator[None]:
        """``optimizer.step`` is the sharded step inside (what Lightning, or a gradient scaler, calls)."""
        step = self.step_of(optimizer)
        if step is None:
            yield
            return
        had = optimizer.__dict__.get("step")
        optimizer.step = step  # type: ignore[method-assign]
        try:
            yield
        finally:
            if had is None:
                del optimizer.__dict__["step"]
            else:
                optimizer.step = had  # type: ignore[method-assign]

    def arm_host_step(self, optimizer: Optimizer, max_norm: Optional[float], norm_type: float, finish_in_forward: bool,
                      checks_nonfinite: bool) -> bool:
        """Offload: step each unit of ``optimizer`` on the CPU as its gradient lands in the next backward (host_step.py;
        the runtime's ``arm_host_step`` says when); whether it is armed. ``checks_nonfinite``: a non-finite gradient
        skips or stops the step (``nonfinite``), decided with clipping at the end of backward."""
        step = self.step_of(optimizer)
        stepper = self.host_stepper
        if step is None or stepper is None:
            return False
        clip = None if max_norm is None else (float(max_norm), check_norm_type(norm_type))
        return stepper.arm(step, clip, decides=clip is not None or checks_nonfinite,
                           finish_in_forward=finish_in_forward)

    def step(self, optimizer: Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
        """``optimizer.step(closure)`` for the sharded model: its sharded step (the optimizer must be attached)."""
        sharded_step = self.step_of(optimizer)
        if sharded_step is None:
            raise ValueError("lightning_shard: attach the optimizer first (`runtime.attach_optimizer(optimizer)`).")
        return sharded_step(closure)

    def _describe(self, tensor: Tensor) -> str:
        """A tensor that is not a sharded parameter, for an error: its name where the model registers it."""
        name = next((n for n, p in self.root.named_parameters() if p is tensor), None)
        if name is not None:
            return f"{name!r} (registered after sharding)"
        return f"a tensor of shape {tuple(tensor.shape)} outside the model"

    def _is_placeholder(self, param: object) -> bool:
        entry = self._placeholders.get(id(param))
        return entry is not None and entry[0] is param
