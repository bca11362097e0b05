"""Scenarios for test_qlora.py's planted bytes (issue 48): packed 4-bit weights whose bytes read as bf16 NaNs, infs
and subnormals, through every path that moves them."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_shard.checkpoint.full import full_state_dict
from tests.mixed_scenarios import batches
from tests.qlora_scenarios import _sharded_steps, qlora_model

# -- packed bytes that read as bf16 NaN, inf, subnormals: never numbers --------------------------------------------
# bf16 quiet and signalling NaNs with payloads, +-inf, subnormals, -0: patterns a float cast changes (an fp32
# round trip quiets the signalling NaN; fp16 has no such NaNs, infs or subnormals at all)
PATTERNS = [0x7FC1, 0xFFC3, 0x7F81, 0xFF82, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x007F, 0x8000]


def _plant(model) -> dict[str, torch.Tensor]:
    """Every packed weight's bf16 storage gets the patterns, spread through it (every rank's part holds some)."""
    planted = {}
    for name, param in model.named_parameters():
        if type(param).__name__ == "Params4bit":
            words = param.data.view(torch.int16).view(-1)
            for i, pattern in enumerate(PATTERNS):
                words[i :: len(PATTERNS) + 3] = pattern - (1 << 16 if pattern & 0x8000 else 0)
            planted[name] = param.data.clone()
    return planted


def _packed_bytes(state: dict, names: dict[str, str]) -> dict[str, torch.Tensor]:
    return {name: state[key].contiguous().view(torch.uint8) for name, key in names.items()}


def planted_bytes(rank: int, world: int, base: str, work: str) -> dict:
    """A QLoRA model (bf16 packed storage, double quantization) whose packed bytes read as bf16 NaNs, infs and
    subnormals, through: a gather under fp16 mixed precision (in forward), a training step, a full state dict, a
    sharded checkpoint loaded into another model, consolidation, a full state dict loaded into another model, an
    offloaded run, and a merged export (dequantized). The packed bytes at each point, by weight name (the sharded
    checkpoint, in ``work``, is consolidated by the test: in one process, without a process group)."""
    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.export import save_pretrained
    from lightning_shard.checkpoint.full import load_full_state_dict
    from lightning_shard.checkpoint.io import open_checkpoint, save_sharded
    from lightning_shard.engine.shard_module import shard_module

    case = ("nf4", "bfloat16", True)
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def build(plant: bool, **options):
        torch.manual_seed(0)
        model = qlora_model(base, *case)
        planted = _plant(model) if plant else {}
        runtime = shard_module(model, units=["LlamaDecoderLayer"], **options)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        runtime.attach_optimizer(optimizer)
        return model, runtime, optimizer, planted

    def watch(model, label: str) -> None:
        def record(module, _, key: str) -> None:
            seen.setdefault(label, {}).setdefault(key, module.weight.data.clone().view(torch.uint8))

        for name, module in model.named_modules():  # the weight a 4-bit layer computes with, gathered
            if type(module).__name__ == "Linear4bit":
                module.register_forward_pre_hook(lambda m, args, key=f"{name}.weight": record(m, args, key))

    model, runtime, optimizer, planted = build(True, param_dtype=torch.float16, reduce_dtype=torch.float32)
    names = {name: name for name in planted}
    watch(model, "gathered")
    _sharded_steps(model, runtime, optimizer, batches()[:1], rank, world)
    points = {"trained": _packed_bytes(full_state_dict(runtime, rank0_only=False), names)}
    save_sharded({"state_dict": sharded.model_state(runtime),
                  "optimizer_states": [sharded.optimizer_state(runtime, optimizer)]}, Path(work) / "sharded")
    full = full_state_dict(runtime, rank0_only=False)
    other, other_runtime, _, _ = build(False)
    source = open_checkpoint(Path(work) / "sharded")["state_dict"]
    sharded.load_model_state(other_runtime, source.directory, source.metadata)
    points["sharded checkpoint"] = _packed_bytes(full_state_dict(other_runtime, rank0_only=False), names)
    other, other_runtime, _, _ = build(False)
    load_full_state_dict(other_runtime, full)
    points["full checkpoint"] = _packed_bytes(full_state_dict(other_runtime, rank0_only=False), names)
    offloaded, offload_runtime, offload_optimizer, _ = build(True, offload="params")
    watch(offloaded, "gathered offloaded")
    _sharded_steps(offloaded, offload_runtime, offload_optimizer, batches()[:1], rank, world)
    points["offloaded"] = _packed_bytes(full_state_dict(offload_runtime, rank0_only=False), names)
    save_pretrained(model, Path(work) / "merged", merged=True)
    reference = qlora_model(base, *case)
    _plant(reference)
    exported = {}
    if rank == 0:
        from safetensors.torch import load_file

        from bitsandbytes.functional import dequantize_4bit

        files = load_file(str(Path(work) / "merged" / "model.safetensors"))
        for name, param in reference.named_parameters():
            if name in planted and "base_layer" not in name:  # a 4-bit layer without an adapter: dequantized alone
                key = name.removeprefix("base_model.model.")
                exported[name] = (files[key], dequantize_4bit(param.data, param.quant_state))
    return {"planted": {k: v.view(torch.uint8) for k, v in planted.items()}, "points": points, "seen": seen,
            "exported": exported}
