"""Scenarios for test_preference.py: TRL's preference trainers with peft (DPO, ORPO, KTO; preference_losses.py) as
Lightning modules, each trained by a real ``Trainer(strategy=ShardStrategy(...))`` and by Lightning's ``"ddp"`` on the
same data and seeds, in one gloo world. Each returns both runs' per-micro-batch losses (this rank's) and final states
(every weight: adapters, frozen base, the reference copy) for the test to compare."""

from __future__ import annotations

import logging
import traceback
import warnings
from dataclasses import dataclass, field, replace
from typing import Optional

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_shard import MixedPrecision, ShardStrategy
from tests.lightning_port_models import state_of
from tests.preference_losses import PreferenceTuning, lora_llama, pairs, unpaired
from tests.world import as_lightning_rank

STEPS, PER_DEVICE = 3, 2
FP32_GATHERS = {"mixed_precision": MixedPrecision()}


@dataclass(frozen=True)
class Case:
    loss: str
    reference: str = "disable_adapter"
    sharding: str = "full"
    accumulate: int = 1
    reduce_during_accumulation: bool = True
    clip: Optional[float] = None
    label_smoothing: float = 0.0
    precision: str = "32-true"
    shard_options: dict = field(default_factory=dict, hash=False)
    checkpointing: Optional[dict] = field(default=None, hash=False)  # HF's activation checkpointing kwargs
    optimizer: str = "adamw"
    against_fp32: bool = False  # also DDP at 32-true: how far bf16 alone moves the result
    base: str = "fp32"  # "bf16": a bf16 base with fp32 adapters; "nf4": QLoRA
    validate: bool = False  # 2 validation batches after every 2 training batches


CASES = {
    # fp32: DDP's numbers (rtol 1e-5, atol 1e-6; most are bit for bit at 2 ranks)
    "dpo_disable_adapter_full": Case("dpo"),
    "dpo_disable_adapter_grad_op_clip_label_smoothing": Case("dpo", sharding="grad_op", clip=0.05,
                                                             label_smoothing=0.1),
    "dpo_precomputed_full_accumulate_no_reduce": Case("dpo", "precomputed", accumulate=2,
                                                      reduce_during_accumulation=False),
    "dpo_precomputed_held_grad_op": Case("dpo", "precomputed_held", sharding="grad_op"),
    "dpo_ref_copy_grad_op_accumulate_clip": Case("dpo", "copy", sharding="grad_op", accumulate=2, clip=0.05),
    "dpo_ref_adapter_full_validation": Case("dpo", "ref_adapter", validate=True),
    "dpo_disable_adapter_hf_checkpointing": Case("dpo", checkpointing={"use_reentrant": False}),
    "dpo_disable_adapter_hf_checkpointing_reentrant_grad_op": Case("dpo", sharding="grad_op",
                                                                   checkpointing={"use_reentrant": True}),
    "dpo_disable_adapter_elide_prefetch_2": Case("dpo", shard_options={"elide_backward_gathers": True,
                                                                       "prefetch": 2}),
    "dpo_disable_adapter_activation_checkpointing": Case("dpo", shard_options={"activation_checkpointing": True}),
    "dpo_disable_adapter_offload_optimizer_accumulate_no_reduce": Case(
        "dpo", accumulate=2, reduce_during_accumulation=False, shard_options={"offload": "optimizer"}),
    "dpo_bf16_base_disable_adapter_grad_op": Case("dpo", sharding="grad_op", base="bf16"),
    "dpo_qlora_disable_adapter_full_clip": Case("dpo", base="nf4", clip=0.05),
    "orpo_full_clip": Case("orpo", None, clip=0.2),
    "orpo_grad_op_accumulate_no_reduce": Case("orpo", None, sharding="grad_op", accumulate=2,
                                              reduce_during_accumulation=False),
    "orpo_no_shard": Case("orpo", None, sharding="none"),
    "kto_precomputed_grad_op_accumulate_no_reduce_clip": Case("kto", "precomputed", sharding="grad_op", accumulate=2,
                                                              reduce_during_accumulation=False, clip=0.02),
    "kto_ref_copy_full": Case("kto", "copy"),
    "kto_ref_adapter_grad_op_validation_keep_gathered": Case("kto", "ref_adapter", sharding="grad_op", validate=True,
                                                             shard_options={"keep_gathered_in_eval": True}),
    "kto_disable_adapter_full_accumulate_no_reduce_validation": Case("kto", accumulate=2,
                                                                     reduce_during_accumulation=False, validate=True),
    "kto_disable_adapter_offload_params_clip": Case("kto", clip=0.02, shard_options={"offload": "params"}),
    # bf16-mixed with fp32 gathers (MixedPrecision()): DDP's numbers under bf16 autocast. KTO's no_grad pass through
    # the policy before its loss pass was refused as "never reduced" before engine/runtime/autocast_casts.py
    "dpo_bf16_mixed_fp32_gathers_accumulate_no_reduce": Case("dpo", accumulate=2, reduce_during_accumulation=False,
                                                             precision="bf16-mixed", shard_options=FP32_GATHERS),
    "kto_bf16_mixed_fp32_gathers_grad_op_accumulate_no_reduce": Case(
        "kto", sharding="grad_op", accumulate=2, reduce_during_accumulation=False, precision="bf16-mixed",
        shard_options=FP32_GATHERS),
    "kto_precomputed_held_bf16_mixed_fp32_gathers": Case("kto", "precomputed_held", precision="bf16-mixed",
                                                         shard_options=FP32_GATHERS),
    "kto_bf16_mixed_fp32_gathers_hf_checkpointing_reentrant": Case(
        "kto", precision="bf16-mixed", shard_options=FP32_GATHERS, checkpointing={"use_reentrant": True}),
    # a bf16 base (fp32 adapters) under bf16-mixed: nothing is gathered in another dtype than DDP computes in
    "kto_bf16_base_bf16_mixed_accumulate_no_reduce": Case("kto", base="bf16", precision="bf16-mixed", accumulate=2,
                                                          reduce_during_accumulation=False),
    # bf16-mixed's default bf16 gathers of an fp32 base: not DDP's numbers (docs/precision.md), measured
    "dpo_bf16_mixed_accumulate_no_reduce": Case("dpo", accumulate=2, reduce_during_accumulation=False,
                                                precision="bf16-mixed"),
    "dpo_bf16_mixed_sgd": Case("dpo", precision="bf16-mixed", optimizer="sgd", against_fp32=True),
}


def _fit(case: Case, world: int, strategy, folder: str) -> tuple[PreferenceTuning, L.Trainer]:
    n = world * PER_DEVICE * case.accumulate * STEPS
    data = unpaired(n, PER_DEVICE) if case.loss == "kto" else pairs(n)
    module = PreferenceTuning(case.loss, data, case.reference or "none", label_smoothing=case.label_smoothing,
                              checkpointing=case.checkpointing, optimizer=case.optimizer, base=case.base,
                              folder=folder)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=case.precision,
                        max_steps=STEPS, accumulate_grad_batches=case.accumulate, gradient_clip_val=case.clip,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=2 if case.validate else 0, val_check_interval=2 if case.validate else None)
    loader = DataLoader(data, batch_size=PER_DEVICE)
    trainer.fit(module, loader, loader if case.validate else None)
    return module, trainer


def against_ddp(case: Case, world: int, folder: str) -> dict:
    shard = ShardStrategy(sharding=case.sharding, units=["LlamaDecoderLayer"],
                          reduce_during_accumulation=case.reduce_during_accumulation, **case.shard_options)
    ours, trainer = _fit(case, world, shard, folder)
    state = state_of(trainer)
    reference, ddp_trainer = _fit(case, world, "ddp", folder)
    initial = lora_llama(base=case.base, folder=folder)[0].state_dict()
    ddp_state = state_of(ddp_trainer)
    moved = max(float((ddp_state[f"model.{k}"] - v).abs().max()) for k, v in initial.items() if "lora_" in k)
    fp32_state = state_of(_fit(replace(case, precision="32-true"), world, "ddp", folder)[1]) if case.against_fp32 else None
    return {"fp32_state": fp32_state, "losses": ours.losses, "ddp_losses": reference.losses, "val_losses": ours.val_losses,
            "ddp_val_losses": reference.val_losses, "checkpointed": ours.checkpointed, "state": state, "ddp_state": ddp_state,
            "grad_norms": reference.grad_norms, "adapters_moved": moved, "steps": trainer.global_step}


def run(rank: int, world: int, names: list[str], folder: str) -> dict[str, dict]:
    """``folder``: a tiny Llama saved as ``save_pretrained`` saves it (mixed_scenarios.write_base), for QLoRA."""
    as_lightning_rank(rank, world)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # (QLoRA's from_pretrained, once per fit)
    out = {}
    for name in names:
        try:
            out[name] = against_ddp(CASES[name], world, folder)
        except Exception as err:  # noqa: BLE001 (reported to the test, which fails naming it)
            out[name] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-4)}"}
        dist.barrier()
    return out


# -- the engine alone: autocast's cast cache (engine/runtime/autocast_casts.py) --------------------------------------
class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def autocast_cache_against_one_process(rank: int, world: int, cases: list[tuple[str, str]]) -> list[float]:
    """Per case ``(sharding, before)``: three fp32 blocks under bf16 autocast, one SGD step, against one process on
    the global batch. ``before`` the loss's forward, in the same autocast region: "nothing", "no_grad" (a forward
    under no_grad: KTO's KL pass) or "backward" (a forward and backward: two manual_backward in one step). The largest
    weight difference after the step."""
    import copy

    from lightning_shard.checkpoint.full import full_state_dict
    from lightning_shard.engine.shard_module import shard_module

    def loss_of(model, x, before: str, scale: float):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if before == "no_grad":
                with torch.no_grad():
                    model(x)
            elif before == "backward":
                (model(x).float().pow(2).mean() * scale).backward()
            return model(x).float().pow(2).mean() * scale

    out = []
    for sharding, before in cases:
        torch.manual_seed(0)
        reference = torch.nn.Sequential(Block(), Block(), Block())
        model = copy.deepcopy(reference)
        runtime = shard_module(model, sharding=sharding, units=[Block])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        runtime.attach_optimizer(optimizer)
        x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
        loss_of(model, x.chunk(world)[rank], before, 1.0).backward()
        runtime.step(optimizer)
        for chunk in x.chunk(world):
            loss_of(reference, chunk, before, 1 / world).backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        full = full_state_dict(runtime, rank0_only=False)
        out.append(max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items()))
    return out
