"""Scenarios for test_autocast_gathers.py, run inside a gloo world: ``precision="bf16-mixed"`` with autocast's gathers
(``cast_params="autocast"``: in bf16 only what autocast casts to bf16 anyway) against Lightning's ddp under the same
autocast, through real Trainers: an fp32 HF Llama trained whole (tied and untied head), and a QLoRA base after peft's
``prepare_model_for_kbit_training``; accumulation of 2 with ``reduce_during_accumulation=False``, 5 AdamW steps."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from lightning_shard.checkpoint.full import full_state_dict
from tests.world import as_lightning_rank

STEPS, ACCUMULATE, ROWS = 5, 2, 2  # optimizer steps, micro-batches per step, rows per rank and micro-batch


def _llama(tied: bool):
    from transformers import LlamaForCausalLM

    from tests.mixed_scenarios import llama_config

    config = llama_config()
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _qlora(base: str):
    from tests.qlora_scenarios import qlora_model

    return qlora_model(base, "nf4", "uint8", True)


def _module(build, rank: int, world: int):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build()
            self.losses: list[float] = []

        def training_step(self, batch, _):
            ids = batch[rank * ROWS : (rank + 1) * ROWS]
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
            self.losses.append(float(self.all_gather(loss.detach().float()).mean()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    return L, Module()


def _fit(build, rank: int, world: int, strategy):
    L, module = _module(build, rank, world)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.DataLoader([torch.randint(0, 96, (ROWS * world, 12), generator=g)
                                        for _ in range(STEPS * ACCUMULATE)], batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-mixed",
                        max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, logger=False, enable_checkpointing=False,
                        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return module, trainer


def against_ddp(rank: int, world: int, model: str, base: str, cast_params: str) -> dict:
    """Losses and the trained weights (largest difference of any) of ShardStrategy under bf16-mixed, with its gathers
    under ``cast_params`` (``"default"``: the precision's own), and of ddp; in which dtype each parameter gathers."""
    from lightning_shard import MixedPrecision, ShardStrategy

    as_lightning_rank(rank, world)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    build = {"llama": lambda: _llama(False), "tied llama": lambda: _llama(True), "qlora": lambda: _qlora(base)}[model]
    policy = None if cast_params == "default" else MixedPrecision(torch.bfloat16, torch.float32, cast_params=cast_params)
    strategy = ShardStrategy(units=["LlamaDecoderLayer"], reduce_during_accumulation=False, mixed_precision=policy)
    sharded, trainer = _fit(build, rank, world, strategy)
    runtime = trainer.strategy.runtime
    full = full_state_dict(runtime, rank0_only=False)
    gathered = {slot.names[0]: str(getattr(slot, "gather_dtype", unit.storage.param_dtype))
                for unit in runtime.units for slot in unit.storage.slots}
    reference, _ = _fit(build, rank, world, "ddp")
    trained = {f"model.{k}": v for k, v in reference.model.state_dict().items()}
    off = {k: float((full[k].double() - v.double()).abs().max()) for k, v in trained.items() if v.is_floating_point()}
    dist.barrier()
    return {"losses": sharded.losses, "ddp_losses": reference.losses, "weights": max(off.values()),
            "worst": max(off, key=off.get), "gathered": gathered}
