"""The optimizer an offloaded run steps on the CPU (offload.py): refused where it cannot step host tensors, and
torch's fused CPU kernel where no implementation was chosen."""

from __future__ import annotations

import torch

from lightning_shard.engine.optim.fused_default import fused_kernels_on

DEVICE_ONLY_PACKAGES = ("bitsandbytes", "apex", "transformer_engine", "torchao")


def prepare_host_step(optimizer: torch.optim.Optimizer) -> bool:
    """With offload the optimizer steps host tensors: refuse, before the first step, one that cannot. Returns
    whether its steps should run torch's fused CPU kernel where no implementation was chosen (Adam and AdamW: 3-4x
    faster than the for-loop torch picks on the CPU, the same formula; ``fused_default.py``)."""
    cls = type(optimizer)
    package = cls.__module__.split(".")[0]
    if package in DEVICE_ONLY_PACKAGES or cls.__module__.startswith("deepspeed.ops.adam.fused_adam"):
        raise ValueError(
            f"lightning_shard: {cls.__name__} (from {package}) steps on the GPU only, and with `offload` the"
            " optimizer steps the CPU's copy of the weights. Use a torch.optim optimizer (AdamW's CPU `fused=True`"
            " runs on the CPU) or offload=None.")
    if any(group.get("fused") for group in optimizer.param_groups):
        if not _fused_on_cpu():
            raise ValueError(
                f"lightning_shard: {cls.__name__}(fused=True) has no CPU kernel in torch {torch.__version__}, and"
                " with `offload` the optimizer steps on the CPU: use fused=False (or foreach=True), or offload=None.")
    return host_step_fused(cls)


def host_step_fused(optimizer_class: type) -> bool:
    """Whether an offloaded step of ``optimizer_class`` runs torch's fused CPU kernel where no implementation was
    chosen."""
    return optimizer_class in (torch.optim.Adam, torch.optim.AdamW) and _fused_on_cpu()


def _fused_on_cpu() -> bool:
    return fused_kernels_on("cpu")
