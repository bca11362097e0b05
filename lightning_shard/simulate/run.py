"""One simulated run: this process is rank ``rank`` of ``world`` (the simulated group), training one model preset
with one strategy for a few steps, and it reports what it measured.

Both strategies get the same model, the same blocks as units (``fully_shard`` per block and on the root for FSDP2),
the same precision (bf16 parameters and compute, fp32 master weights and gradient reduction, no autocast: FSDP2's
``MixedPrecisionPolicy`` as torchtitan runs it), AdamW (fused on CUDA), clipping at 1.0 and the same batches. Memory
is this rank's: on CUDA the allocator's peaks over the timed steps; on the CPU the live tensor bytes of one steady
step (``memory/tracker.py``; FSDP2's DTensor ops are seen at their outputs only).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import nn

from lightning_shard.memory.tracker import LiveBytes
from lightning_shard.simulate import backend
from lightning_shard.simulate.models import MODELS, batches, block_class, build, loss

STRATEGIES = ("ours", "fsdp2")
PRECISIONS = ("bf16-mixed", "32-true")
OFFLOADS = ("none", "optimizer", "params")
LR = 3e-4


@dataclass(frozen=True)
class RunSpec:
    strategy: str
    model: str
    layers: int
    seq: int
    batch: int
    world: int
    link: str
    device: str = "cpu"
    rank: int = 0
    network: str = "ib-ndr"
    per_node: int = 8
    sharing: str = "serial"
    precision: str = "bf16-mixed"
    offload: str = "none"
    prefetch: int = 1
    steps: int = 3
    warmup: int = 2
    estimate: bool = False  # ours: also lightning_shard's estimate of this rank's peak


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Ours:
    def __init__(self, model: nn.Module, spec: RunSpec, device: torch.device, param_dtype: Optional[torch.dtype]):
        from lightning_shard.engine.shard_module import shard_module

        self.runtime = shard_module(model, units=[block_class(model)], param_dtype=param_dtype,
                                    reduce_dtype=torch.float32 if param_dtype else None, prefetch=spec.prefetch,
                                    device=device, offload=None if spec.offload == "none" else spec.offload)
        with self.runtime.shaped_parameters():
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # fused on CUDA: the engine's pick
        self.runtime.attach_optimizer(self.optimizer)
        self.model = model

    def step(self, batch: torch.Tensor) -> float:
        self.runtime.run_step(lambda: loss(self.model, batch)).backward()
        self.runtime.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], 1.0)
        self.runtime.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.runtime.after_optimizer_step()
        return float(self.runtime.last_step_stats.get("exposed_seconds", 0.0))

    def tensors(self) -> list:
        state = [v for s in self.optimizer.state.values() for v in s.values()]
        gathered = [u.storage.gathered for u in self.runtime.units]
        return [*self.model.parameters(), *self.model.buffers(), *gathered, *state]


class _FSDP2:
    def __init__(self, model: nn.Module, spec: RunSpec, device: torch.device, param_dtype: Optional[torch.dtype]):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (spec.world,))
        options: dict[str, Any] = {"mesh": mesh}
        if param_dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if spec.offload == "params":
            options["offload_policy"] = CPUOffloadPolicy()
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        fused = device.type == "cuda" and spec.offload == "none"
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if fused else {}))
        self.model = model

    def step(self, batch: torch.Tensor) -> float:
        loss(self.model, batch).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float("nan")  # FSDP2 does not say

    def tensors(self) -> list:
        local = [getattr(p, "_local_tensor", p) for p in self.model.parameters()]
        state = [getattr(v, "_local_tensor", v) for s in self.optimizer.state.values() for v in s.values()]
        return [*local, *self.model.buffers(), *state]


def run(spec: RunSpec) -> dict:
    """Train ``spec.warmup + spec.steps`` steps; the timed steps' figures."""
    preset = MODELS[spec.model]
    device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    if spec.strategy == "fsdp2" and spec.offload == "optimizer":
        raise ValueError("FSDP2 offloads parameters, gradients and optimizer state together (offload 'params'),"
                         " not the optimizer alone")
    sim = backend.start(spec.world, spec.rank, spec.link, spec.network, spec.per_node, spec.sharing, device)
    param_dtype = torch.bfloat16 if spec.precision == "bf16-mixed" else None
    torch.manual_seed(0)
    with torch.device(device):
        model = build(preset, spec.layers, spec.seq)
    strategy = (_Ours if spec.strategy == "ours" else _FSDP2)(model, spec, device, param_dtype)
    data = batches(preset, spec.batch, spec.seq, spec.warmup + spec.steps + 1, device)
    for batch in data[: spec.warmup]:
        strategy.step(batch)
    if device.type == "cuda":
        _sync(device)
        torch.cuda.empty_cache()  # the full model built before sharding is gone: the peaks are the steps'
        torch.cuda.reset_peak_memory_stats(device)
    times, exposed, modeled, written = [], [], [], []
    for batch in data[spec.warmup: spec.warmup + spec.steps]:
        sim.reset_ledger()
        _sync(device)
        start = time.perf_counter()
        exposed.append(strategy.step(batch))
        _sync(device)
        times.append(time.perf_counter() - start)
        modeled.append(sum(entry[2] for entry in sim.ledger.values()))
        written.append(sum(entry[3] for entry in sim.ledger.values()))
    ledger = {kind: list(entry) for kind, entry in sim.ledger.items()}
    result = {"spec": asdict(spec), "times": times, "step": statistics.median(times),
              "engine_exposed": statistics.median(exposed), "modeled_comm": statistics.median(modeled),
              "written_bytes": statistics.median(written), "ledger": ledger, "device_name": _device_name(device)}
    if device.type == "cuda":
        result["peak"] = torch.cuda.max_memory_allocated(device)
        result["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        result["copy_bytes_per_second"] = sim.occupancy.spin(device).copy_bytes_per_second \
            if sim.topology.node.busbw else None
    else:
        with LiveBytes() as live:
            live.track(strategy.tensors() + [data[-1]])
            strategy.step(data[-1])
        result["peak"] = live.peak
    if spec.estimate and spec.strategy == "ours":
        result["estimate"] = _estimate(spec, preset, device, param_dtype, data[0])
    return result


def _estimate(spec: RunSpec, preset: Any, device: torch.device, param_dtype: Optional[torch.dtype],
              batch: torch.Tensor) -> dict:
    from lightning_shard.memory.estimate import estimate_memory

    with torch.device("meta"):
        model = build(preset, spec.layers, spec.seq)
    estimate = estimate_memory(model, spec.world, units=[block_class(model)], prefetch=spec.prefetch,
                               param_dtype=param_dtype, master_dtype=torch.float32,
                               optimizer=partial(torch.optim.AdamW, lr=LR), step=loss, batch=batch,
                               device=device, offload=None if spec.offload == "none" else spec.offload,
                               zero_grad_before_backward=False)
    return estimate.as_dict()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"
