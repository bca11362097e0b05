"""torch's fused optimizer kernels for the sharded step, where the user chose no implementation.

On a GPU, torch's Adam, AdamW and SGD default to their ``foreach`` implementation: about ten multi-tensor kernels per
step for AdamW, each one more pass over the parameters, gradients and moments (issue 30's trace of a 1.27B model:
633 launches and a quarter of the GPU's busy time per step). Their ``fused`` implementation does the whole update in
one kernel per chunk of tensors, one pass. Where a param group leaves both ``fused`` and ``foreach`` None, the
sharded step runs it fused: the same formula, rounded apart from ``foreach`` by an ulp at times. Only during the
step: the groups keep the user's options (and so do checkpoints). A group that asked for an implementation gets it.

Where: fp32 master shards on a GPU. Not on the CPU, where torch's default (a for-loop) gives DDP's numbers bit for
bit; offload, whose optimizer steps on the CPU, takes the CPU's fused Adam/AdamW (3-4x faster than the for-loop
there: ``offload.py``). Not for other dtypes: torch 2.13's CPU fused SGD steps bf16 parameters wrongly, a reason to
keep to what both fused and foreach are tested on most.

torch's fused SGD creates momentum buffers only when none of the parameters it steps has one yet, and fails when
some have and some not (a parameter unfrozen, or used for the first time, after the others' first step: gradual
unfreezing with one optimizer): such a group steps as torch would choose (foreach) until the mix is gone.

A fused step keeps Adam's ``step`` counters on the parameters' device in fp32, where ``foreach`` keeps them on the
host: counters that came another way (a checkpoint loaded, a step taken before) are moved before the first fused
step after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch.optim import Optimizer

FUSED_BY_DEFAULT = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
GPU_DEVICES = ("cuda", "xpu")  # where torch itself defaults to foreach


def fused_kernels_on(device_type: str) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return device_type in _get_fused_kernels_supported_devices()


def fused_by_default(optimizer_class: type, device: torch.device, master_dtype: torch.dtype) -> bool:
    """Whether the sharded step runs ``optimizer_class`` fused where its groups chose no implementation."""
    return (optimizer_class in FUSED_BY_DEFAULT and master_dtype == torch.float32 and device.type in GPU_DEVICES
            and fused_kernels_on(device.type))


class FusedWhereUnchosen:
    """``with fused():`` around an optimizer's step: its groups that chose no implementation step fused."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._counters_placed = False
        optimizer.register_load_state_dict_post_hook(self._loaded)

    def _loaded(self, optimizer: Optimizer) -> None:
        self._counters_placed = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        unchosen = [group for group in unchosen_groups(self.optimizer)
                    if not _momentum_buffers_mixed(self.optimizer, group)]
        if not self._counters_placed:
            _place_step_counters(self.optimizer, unchosen)
            self._counters_placed = True
        for group in unchosen:
            group["fused"] = True
        try:
            yield
        finally:
            for group in unchosen:
                group["fused"] = None


def unchosen_groups(optimizer: Optimizer) -> list[dict]:
    return [group for group in optimizer.param_groups
            if group.get("fused") is None and group.get("foreach") is None
            and not group.get("differentiable") and not group.get("capturable")]


def _momentum_buffers_mixed(optimizer: Optimizer, group: dict) -> bool:
    """SGD with momentum: some parameters about to be stepped have a momentum buffer, some not."""
    if not isinstance(optimizer, torch.optim.SGD) or not group.get("momentum"):
        return False
    held = {optimizer.state.get(p, {}).get("momentum_buffer") is not None for p in group["params"] if p.grad is not None}
    return len(held) == 2


def _place_step_counters(optimizer: Optimizer, groups: list[dict]) -> None:
    """Adam's ``step`` of each parameter where its fused kernel reads it: a 0-dim fp32 tensor on its device."""
    for group in groups:
        for param in group["params"]:
            state: Optional[dict] = optimizer.state.get(param)
            step = state.get("step") if state else None
            if isinstance(step, torch.Tensor) and (step.device != param.device or step.dtype != torch.float32):
                state["step"] = step.to(device=param.device, dtype=torch.float32)
