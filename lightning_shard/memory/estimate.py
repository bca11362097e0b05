"""Per-rank peak memory of a sharded training step, predicted before running it.

    peak = parameter shards + optimizer state + buffers + root unit (gathered all step)
           + max( activations + gathered units + gradient shards held,      # end of forward
                  activations + gathered units + gradients in flight
                              (+ gradient shards held, accumulating),       # start of backward
                  gradient shards + optimizer step scratch )               # optimizer step

Every term is counted, not guessed: unit sizes come from the same planner the strategy uses (padding
included); optimizer state and step scratch per parameter element from real steps of the optimizer on small
probe tensors, the state for the trainable elements alone (frozen ones, a LoRA base, hold none; a unit's
trainable elements are counted whole on each rank, as they may all lie in one rank's shard). The scratch of one
step is one step group's (``step_group_numel`` elements per rank), or one parameter's when the optimizer updates
parameter by parameter (torch's for-loop implementations, the CPU default; the probes tell which); a
whole-parameter optimizer (Muon, Adafactor) adds the owners' exchange buffers and the full copies of the
parameters a rank owns in one group. Activations (and backward temporaries) from one forward and backward of the
model on fake tensors of the target device (``FakeTensorMode``: real kernels are chosen, e.g. CPU flash attention, nothing
is allocated), with the chosen activation checkpointing applied. Gathered units and
gradients in flight follow the engine's bounds: ``1 + prefetch`` units gathered under ``full`` sharding (one
at one rank, where each is cast as it runs), all of them from forward to backward under ``grad_op``.

Gradient shards held beside the activations: Lightning's automatic optimization calls ``zero_grad`` between a
step's forward and its backward, so the last step's gradient shards are alive through the forward
(``zero_grad_before_backward``, the default); with ``accumulate_grad_batches > 1`` the micro-batches' sums are
alive through the next micro-batches' forward and backward (without ``reduce_during_accumulation``, every unit's
unsharded gradient is). Activations are measured under the training's autocast (``autocast``: Lightning's
``bf16-mixed`` and ``16-mixed``), which keeps some outputs in fp32 (norms, softmax, the loss) and casts copies.

With ``offload`` the terms split by where they live: the master shards, their gradients, a compute-dtype staging
copy, the optimizer state and its scratch go to ``host`` (host memory, stepped by the CPU: the probes run there);
the device keeps the compute-dtype shards (``offload="optimizer"``; none under ``"params"``) and the rest.

CLI for a Hydra training config: ``python -m lightning_shard.estimate`` (``lightning_shard.app.estimate``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_shard.engine.comm.groups import validate_shard_size, validate_sharding
from lightning_shard.engine.optim.fused_default import FusedWhereUnchosen, fused_by_default
from lightning_shard.engine.optim.host_optimizer import host_step_fused
from lightning_shard.engine.optim.optimizer_step import DEFAULT_STEP_GROUP_NUMEL
from lightning_shard.engine.plan.gathers import GatherDtypes
from lightning_shard.engine.plan.plan import UnitSpec, full_precision_classes, plan_units
from lightning_shard.engine.runtime.activation_checkpointing import CheckpointSpec, validate_activation_checkpointing
from lightning_shard.engine.storage.offload import validate_offload
from lightning_shard.memory.activations import activation_bytes
from lightning_shard.memory.tracker import LiveBytes
from lightning_shard.memory.units import UnitSize, planned_sizes, sharded_sizes

MiB = 2**20


@dataclass
class MemoryEstimate:
    """Bytes per rank at the peak of a training step, by kind."""

    params: int  # parameter shards (master dtype) and the root unit, which stays gathered all step
    optimizer_state: int
    buffers: int
    grads: int  # gradient shards, complete at the end of backward
    gathered: int  # other units gathered at once
    grads_in_flight: int  # unsharded gradients: the root unit's and the largest unit's
    activations: int  # saved for backward plus backward temporaries (local batch)
    step_scratch: int  # temporaries of the optimizer step
    grads_in_forward: int = 0  # gradient shards alive through the forward (last step's, or accumulated sums)
    grads_in_backward: int = 0  # gradients of earlier micro-batches alive through the backward (accumulating)
    # offload, in host memory: master and staging shards and the optimizer state; gradient shards and step scratch
    host_resident: int = 0
    host_step: int = 0
    average: int = 0  # an average of the weights kept beside the shards on the device (ShardedWeightAveraging)
    # async_save: host memory a rank keeps for the copy of its checkpoint that is written in the background
    checkpoint_staging: int = 0

    @property
    def host(self) -> int:
        """In host memory, beside ``peak``: offload's share and the checkpoint staging."""
        return self.host_resident + self.host_step + self.checkpoint_staging

    @property
    def host_uses(self) -> str:
        """What ``host`` holds, in words."""
        uses = [name for name, size in (("offload", self.host_resident + self.host_step),
                                         ("async checkpoint staging", self.checkpoint_staging)) if size]
        return ", ".join(uses)

    @property
    def peak(self) -> int:
        """On the device (with offload, ``host`` is apart)."""
        return sum(self.peak_parts().values())

    def peak_parts(self) -> dict[str, int]:
        """The rows that add up to ``peak``: those alive all step, and those of the phase whose sum is largest."""
        resident = {"params": self.params, "optimizer_state": self.optimizer_state, "buffers": self.buffers,
                    "average": self.average}
        forward = {"activations": self.activations, "gathered": self.gathered,
                   "grads_in_forward": self.grads_in_forward}
        # backward peaks at its start, with every activation alive: this step's gradient shards come later, as
        # activations go
        backward = {"activations": self.activations, "gathered": self.gathered, "grads_in_flight": self.grads_in_flight,
                    "grads_in_backward": self.grads_in_backward}
        step = {"grads": self.grads, "step_scratch": self.step_scratch}
        return {**resident, **max(forward, backward, step, key=lambda phase: sum(phase.values()))}

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "peak": self.peak, "host": self.host}

    def table(self, omit: Sequence[str] = ()) -> str:
        """One row per figure, in MiB; ``omit`` leaves rows out (the setup's estimate has no activations)."""
        rows = [f"  {name:<18} {value / MiB:10.1f} MiB" for name, value in self.as_dict().items()
                if not name.startswith("host") and name not in omit]
        if self.host:  # offload, async checkpoint staging
            rows[-1] += " on the device"
            rows.append(f"  {'host':<18} {self.host / MiB:10.1f} MiB in host memory ({self.host_uses})")
        return "\n".join(rows)


def estimate_memory(
    model: nn.Module,
    world_size: int,
    sharding: str = "full",
    units: Optional[Sequence[UnitSpec]] = None,
    unit_size: Optional[int] = None,
    min_unit_size: Optional[int] = None,
    prefetch: int = 1,
    param_dtype: Optional[torch.dtype] = None,
    master_dtype: Optional[torch.dtype] = None,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    step: Optional[Callable[[nn.Module, Any], Tensor]] = None,
    batch: Any = None,
    activation_checkpointing: CheckpointSpec = False,
    device: Union[str, torch.device] = "cpu",
    whole: bool = False,
    step_group_numel: int = DEFAULT_STEP_GROUP_NUMEL,
    shard_size: Optional[int] = None,
    offload: Optional[str] = None,
    autocast: Optional[torch.dtype] = None,
    zero_grad_before_backward: bool = True,
    accumulate_grad_batches: int = 1,
    reduce_during_accumulation: bool = True,
    async_save: bool = False,
    cast_params: str = "all",
) -> MemoryEstimate:
    """Predict one rank's peak memory for training ``model`` sharded over ``world_size`` ranks (under
    ``sharding="hybrid"``, over groups of ``shard_size``: the replicas add no memory).

    ``model`` may live on any device, the meta device included; it is not modified. ``device`` is where
    training will run (its kernels decide the activations, e.g. which attention kernel). ``step(model, batch)``
    returns the loss of one local (per-rank) ``batch``; without it no activations are counted.
    ``optimizer`` is called like ``optimizer(params)``: an optimizer class or a ``functools.partial``.
    ``param_dtype`` is the gather/compute dtype (mixed precision), ``master_dtype`` that of the shards.
    ``whole``: the optimizer steps whole parameters on owner ranks (``engine/optim/optimizers.py``);
    ``step_group_numel``: the strategy's ``step_group_size``; ``offload``: the strategy's.
    ``autocast``: the dtype ``step`` runs under ``torch.autocast`` in training (Lightning's mixed precisions).
    ``zero_grad_before_backward``: gradients are cleared between a step's forward and its backward, as Lightning's
    automatic optimization does (the last step's are alive through the forward); ``False``: after the optimizer step.
    ``accumulate_grad_batches``, ``reduce_during_accumulation``: the Trainer's and the strategy's. ``cast_params``:
    which parameters gather in ``param_dtype`` (the precision's policy: ``"autocast"`` under bf16-mixed).
    ``async_save``: the strategy's; its checkpoint staging is counted in ``host``.
    """
    validate_sharding(sharding)
    offload = validate_offload(offload)
    shard_size = validate_shard_size(shard_size, sharding)
    if sharding == "hybrid" and (shard_size is None or world_size % shard_size):
        raise ValueError(f"estimate_memory: sharding='hybrid' needs `shard_size` (ranks per shard group) dividing the"
                         f" world size {world_size}, got {shard_size}.")
    spec = validate_activation_checkpointing(activation_checkpointing)
    if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
        raise ValueError(f"estimate_memory: `accumulate_grad_batches` must be an int >= 1, got {accumulate_grad_batches!r}.")
    # batch norms are units of their own under mixed precision, as shard_module plans them
    plans = plan_units(model, units=units, unit_size=unit_size, min_unit_size=min_unit_size,
                       own_units=full_precision_classes(param_dtype))
    # the dtype of what trains (optimizer state, gradients): a LoRA model's fp32 adapters beside its bf16 base
    params = list(model.parameters())
    master = master_dtype or next((p.dtype for p in params if p.requires_grad), params[0].dtype if params
                                  else torch.float32)
    ranks = {"none": 1, "hybrid": shard_size}.get(sharding, world_size)
    sizes = planned_sizes(model, plans, ranks, param_dtype, master_dtype, cast_params)
    gathers = GatherDtypes(model, param_dtype, cast_params) if param_dtype is not None else None
    param_dtype = param_dtype or master
    activations = (activation_bytes(model, step, batch, param_dtype, plans, spec, device, autocast, gathers)
                   if step is not None else 0)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    profile = optimizer_profile(optimizer, master, whole, "cpu" if offload else device, host_step=offload is not None)
    held = GradsHeld(zero_grad_before_backward, accumulate_grad_batches, reduce_during_accumulation)
    estimate = combine(sizes, master, param_dtype, sharding, prefetch, profile, buffers, activations,
                       step_group_numel, offload, held)
    estimate.checkpoint_staging = checkpoint_staging(sizes, profile, buffers) if async_save else 0
    return estimate


def checkpoint_staging(sizes: list[UnitSize], optimizer: OptimizerProfile, buffers: int) -> int:
    """What ``async_save`` copies into host memory and keeps across saves: a rank's master shards (all of them: a
    checkpoint leaving frozen ones out copies less), its optimizer state and the buffers."""
    return sum(u.master_bytes for u in sizes) + round(sum(u.stepped for u in sizes) * optimizer.state) + buffers


@dataclass(frozen=True)
class GradsHeld:
    """How the training loop keeps gradients beside a step's activations (see the module note)."""

    zero_grad_before_backward: bool = True  # Lightning's automatic optimization
    accumulate_grad_batches: int = 1
    reduce_during_accumulation: bool = True

    def bytes(self, shards: int, unsharded: int) -> tuple[int, int]:
        """In forward and in backward, from the gradient shards' bytes and every unit's unsharded gradients'."""
        if self.accumulate_grad_batches == 1:
            return (shards if self.zero_grad_before_backward else 0), 0
        if self.reduce_during_accumulation:
            return shards, shards
        # after the first micro-batch, every unit's unsharded sums and, on the shard parameters, the marks a zero_grad
        # would clear (engine/runtime/reduce.py): a gradient shard each
        return unsharded + shards, unsharded + shards


@dataclass(frozen=True)
class OptimizerProfile:
    """What the optimizer holds and needs per parameter element, measured on probes."""

    state: float  # bytes of state kept per element
    scratch: float  # bytes of temporaries per element updated at once
    per_parameter: bool  # its temporaries live for one parameter at a time (a for-loop implementation)
    whole: bool  # it steps whole parameters on owner ranks


def combine(sizes: list[UnitSize], master: torch.dtype, param_dtype: torch.dtype, sharding: str, prefetch: int,
            optimizer: OptimizerProfile, buffers: int, activations: int,
            step_group_numel: int = DEFAULT_STEP_GROUP_NUMEL, offload: Optional[str] = None,
            held: GradsHeld = GradsHeld()) -> MemoryEstimate:
    """The formula of the module note, from unit sizes (planned, or read off a sharded model)."""
    b_master, b_param = _size(master), _size(param_dtype)  # master: what trains (its gradients, its state)
    # gathered buffer = shard
    one_shard = all(u.padded == u.shard for u in sizes)
    aliases = one_shard and param_dtype == master and offload is None
    shard_bytes = sum(u.master_bytes for u in sizes)  # counted by dtype (memory/units.py)
    stepped = sum(u.stepped for u in sizes)  # what the optimizer keeps state for (frozen parameters: none)
    graded = sum(u.graded for u in sizes)  # a unit of one dtype that trains reduces its whole flat shard
    root = sum(u.gathered_bytes for u in sizes if u.is_root)
    root_grads = sum(u.grad_numel for u in sizes if u.is_root)
    others = sorted((u.gathered_bytes for u in sizes if not u.is_root), reverse=True)
    if aliases:
        at_once = 0
    elif sharding in ("full", "hybrid"):
        ahead = 0 if one_shard and offload is None else prefetch  # one shard: each unit cast as it runs (gather.py)
        at_once = 1 + ahead
    else:  # grad_op keeps every unit gathered from its forward to its backward; none keeps them always
        at_once = len(others)
    gathered = sum(others[:at_once])
    # the root's gradients build up through all of backward; a unit's until its reduction (``engine/runtime/reduce.py``),
    # which flattens them into the reduce dtype (master's here), computing in another through a concatenation in
    # theirs. The reduction left in flight while the next unit computes is not added: that unit's activations are
    # freed by then, which outweigh it unless activations are tiny
    largest = max((u.grad_numel for u in sizes if not u.is_root and u.stepped), default=0)
    if aliases:  # one rank in the master dtype: each gradient becomes its shard's as autograd made it
        grads_in_flight = (largest + root_grads) * b_param
    else:
        casting = b_param if param_dtype != master else 0
        grads_in_flight = root_grads * b_param + largest * (b_param + b_master + casting)
    # accumulated without reduction: summed in the reduction's dtype, the master's here (engine/storage/unsharded_grads.py)
    unsharded = sum(u.grad_numel for u in sizes) * b_master
    if offload is not None:  # the gradient shards go to the host as they are made
        in_forward, in_backward = held.bytes(0, unsharded)
        state, scratch = round(stepped * optimizer.state), step_scratch(sizes, b_master, optimizer, step_group_numel)
        staged = sum(u.gather_shard_bytes for u in sizes)
        if offload == "params":  # a gathered unit keeps the device copy of the shard it was gathered from (offload.py)
            sent = sorted((u.gather_shard_bytes for u in sizes if not u.is_root), reverse=True)[:at_once]
            gathered += sum(sent) + sum(u.gather_shard_bytes for u in sizes if u.is_root)
        return MemoryEstimate(
            params=(staged if offload == "optimizer" else 0) + root,
            optimizer_state=0, buffers=buffers, grads=0, gathered=gathered, grads_in_flight=grads_in_flight,
            activations=activations, step_scratch=0, grads_in_forward=in_forward, grads_in_backward=in_backward,
            host_resident=shard_bytes + staged + state,
            host_step=sum(u.graded if u.mixed else u.shard for u in sizes) * b_master + scratch,
        )
    in_forward, in_backward = held.bytes(graded * b_master, unsharded)
    return MemoryEstimate(
        params=shard_bytes + (0 if aliases else root),
        optimizer_state=round(stepped * optimizer.state),
        buffers=buffers,
        grads=graded * b_master,
        gathered=gathered,
        grads_in_flight=grads_in_flight,
        activations=activations,
        step_scratch=step_scratch(sizes, b_master, optimizer, step_group_numel),
        grads_in_forward=in_forward,
        grads_in_backward=in_backward,
    )


def step_scratch(sizes: list[UnitSize], b_master: int, optimizer: OptimizerProfile, step_group_numel: int) -> int:
    """Temporaries of one optimizer step (``engine/optim/optimizer_step.py``): it runs one step group at a time."""
    stepped = sum(u.stepped for u in sizes)
    largest = max((u.largest for u in sizes), default=0)
    ranks = max((u.padded // u.shard for u in sizes if u.shard), default=1)
    at_once = min(step_group_numel, stepped)  # elements per rank one group steps
    if not optimizer.whole or ranks == 1:  # stepped where the shards (or, unsharded, whole parameters) lie
        local_piece = min(largest, max((u.shard for u in sizes), default=0)) if ranks > 1 else largest
        return round(optimizer.scratch * (local_piece if optimizer.per_parameter else at_once))
    # owners: a group is (part of) one unit, whose parameters an owner holds whole, at most one more than its share
    group = min(step_group_numel, max((u.shard for u in sizes), default=0))
    owned = group + largest
    in_flight = 4 * group + 2 * owned + 2 * group  # next group's values+gradients out and in, this one's, its return
    return round(in_flight * b_master + optimizer.scratch * (largest if optimizer.per_parameter else owned))


def estimate_sharded(runtime: Any, sharding: str, prefetch: int, optimizer: Callable[..., torch.optim.Optimizer],
                     whole: bool = False, step_group_numel: int = DEFAULT_STEP_GROUP_NUMEL,
                     held: GradsHeld = GradsHeld(), async_save: bool = False) -> MemoryEstimate:
    """The estimate, activations excluded, of a model already sharded (what the strategy logs at setup)."""
    sizes = sharded_sizes(runtime)
    # what trains decides the gradients' and the optimizer state's dtypes (a LoRA model: its fp32 adapters)
    first = next((u.storage for u in runtime.units if u.storage.trainable), runtime.units[0].storage)
    master = next((first.shard_params[i].dtype for i in first.trainable), first.master_dtype)
    buffers = sum(b.numel() * b.element_size() for b in runtime.root.buffers())
    profile = optimizer_profile(optimizer, master, whole, first.shard.device,  # offloaded: the host
                                host_step=first.offloaded)
    estimate = combine(sizes, master, first.param_dtype, sharding, prefetch, profile, buffers, 0,
                       step_group_numel, "optimizer" if first.offloaded and first.host.keep_on_device
                       else "params" if first.offloaded else None, held)
    estimate.checkpoint_staging = checkpoint_staging(sizes, profile, buffers) if async_save else 0
    return estimate


def optimizer_profile(optimizer: Callable[..., torch.optim.Optimizer], dtype: torch.dtype, whole: bool = False,
                      device: Union[str, torch.device] = "cpu", host_step: bool = False) -> OptimizerProfile:
    """State and scratch per element from real steps on probes (2-D ones for a whole-parameter optimizer: Muon
    takes nothing else). One probe, then three: temporaries that grow with the number of parameters stepped
    together (``torch._foreach`` lists, the GPU default) count per element of a step group; those that do not
    (torch's for-loop implementations, the CPU default: the last parameter's outlive the next one's start) count
    per element of the largest parameter."""
    device = torch.device(device)
    if device.type == "meta" or (device.type == "cuda" and not torch.cuda.is_available()):
        device = torch.device("cpu")
    shape = (64, 64) if whole else (4096,)
    n = math.prod(shape)
    state_one, scratch_one = _probe(optimizer, dtype, [shape], device, host_step)
    _, scratch_three = _probe(optimizer, dtype, [shape] * 3, device, host_step)
    per_parameter = scratch_three < 2.5 * scratch_one
    return OptimizerProfile(state=state_one / n, scratch=(scratch_three if per_parameter else scratch_three / 3) / n,
                            per_parameter=per_parameter, whole=whole)


def _probe(optimizer: Callable[..., torch.optim.Optimizer], dtype: torch.dtype, shapes: list[tuple[int, ...]],
           device: torch.device, host_step: bool = False) -> tuple[int, int]:
    """Bytes of state after a step, and the peak of temporaries during a second step, over ``shapes``."""
    probes = [nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for shape in shapes]
    for probe in probes:
        probe.grad = torch.full(probe.shape, 1e-3, dtype=dtype, device=device)
    opt = optimizer(probes)
    # as the sharded step runs it: fused where its groups chose no implementation, on a GPU (fused_default.py), and
    # offloaded (``host_step``) on the CPU for Adam/AdamW (offload.py)
    runs_fused = host_step_fused(type(opt)) if host_step else fused_by_default(type(opt), device, dtype)
    fused = FusedWhereUnchosen(opt) if runs_fused else contextlib.nullcontext
    with fused():
        opt.step()  # creates the state
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    state = sum(v.numel() * v.element_size() for v in states if v.dim() > 0)
    with LiveBytes() as live, fused():
        live.track([*probes, *[p.grad for p in probes], *states])
        live.reset_peak()
        baseline = live.current()
        opt.step()
    return state, max(live.peak - baseline, 0)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

