"""Scenarios for test_mixed_dtypes.py: units of several dtypes (a bf16 base beside peft's fp32 LoRA adapters) on the
paths that were built beside them: writes into their gathered copies (a LoRA weight constraint in Lightning's
``on_before_zero_grad``, ``keep_gathered(modifier_rank=)``), ``p.data = ...`` on their parameters, parameters frozen or
unfrozen between micro-batches, weight averaging. Against DDP, or one process on the global batch."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.engine.shard_module import shard_module
from tests.mixed_scenarios import VOCAB, batches, llama_config
from tests.world import as_lightning_rank

# below most of lora_A's gaussian start (std 1/r), so the constraint changes them at every step; a power of two, so
# that a bf16 copy holds it exactly (under bf16-mixed the elements written are taken in the gathered dtype)
CLIP = 0.0625


def lora_llama(targets: tuple[str, ...] = ("q_proj", "v_proj")):
    """A tiny Llama in bf16 with peft's LoRA adapters in fp32 (peft's default): a unit of several dtypes per layer."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()).to(torch.bfloat16)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0,
                                            init_lora_weights="gaussian"))


def _constrained_module(averaging: bool = False):
    import lightning as L

    class Constrained(L.LightningModule):
        """LoRA with a max-value constraint on lora_A, written where Lightning's docs put such code:
        ``on_before_zero_grad``, after the step's forward and before its backward."""

        def __init__(self, chunk: slice, targets: tuple[str, ...]) -> None:
            super().__init__()
            self.model, self.chunk = lora_llama(targets), chunk
            self.losses: list[float] = []

        def training_step(self, batch, _):
            ids = batch[self.chunk]
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
            self.losses.append(float(self.all_gather(loss.detach().float()).mean()))
            return loss

        def on_before_zero_grad(self, optimizer):
            for name, param in self.named_parameters():
                if "lora_A" in name:
                    param.data.clamp_(-CLIP, CLIP)

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    return L, Constrained


def _fit(rank: int, world: int, strategy, targets: tuple[str, ...], precision: str = "32-true",
         callbacks: tuple = ()):
    L, Constrained = _constrained_module()
    size = 6 // world
    module = Constrained(slice(rank * size, (rank + 1) * size), targets)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=precision, max_steps=3,
                        logger=False, enable_checkpointing=False, use_distributed_sampler=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, torch.utils.data.DataLoader(batches(), batch_size=None))
    return module, trainer


def constraint_against_ddp(rank: int, world: int, cases: list[tuple[str, tuple[str, ...], str]]) -> list[dict]:
    """Per ``(sharding, LoRA targets, precision)``: the constraint written into gathered copies of units of several dtypes (LoRA on
    ``lm_head`` makes the root unit one, gathered from the step's start to its backward; ``grad_op`` keeps every
    layer gathered from forward to backward), the adapters and losses beside DDP's."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    results = []
    for sharding, targets, precision in cases:
        strategy = ShardStrategy(sharding=sharding, units=["LlamaDecoderLayer"])
        sharded, trainer = _fit(rank, world, strategy, targets, precision)
        full = full_state_dict(trainer.strategy.runtime, rank0_only=False)
        mixed = sorted(u.name for u in trainer.strategy.runtime.units if type(u.storage).__name__ == "MixedShard")
        reference, _ = _fit(rank, world, "ddp", targets, precision)
        results.append({
            "case": (sharding, targets, precision), "mixed": mixed, "losses": sharded.losses, "ddp_losses": reference.losses,
            "adapters": {k: v for k, v in full.items() if "lora_" in k},
            "ddp_adapters": {k: v.detach().clone() for k, v in reference.state_dict().items() if "lora_" in k},
        })
    dist.barrier()
    return results


def averaging_refused(rank: int, world: int) -> str:
    """ShardedEMA on a bf16 base with fp32 adapters, under bf16-mixed: the error it stops with."""
    from lightning_shard import ShardedEMA, ShardStrategy

    as_lightning_rank(rank, world)
    try:
        _fit(rank, world, ShardStrategy(units=["LlamaDecoderLayer"]), ("q_proj", "v_proj"), "bf16-mixed",
             (ShardedEMA(decay=0.9),))
    except ValueError as err:
        return str(err)
    return "trained"


def _loss_under(autocast: torch.autocast, model, ids: torch.Tensor) -> torch.Tensor:
    """``model``'s loss on ``ids``, its weights cast (under ``autocast``) for this call alone, as each rank's gathers
    are: autocast caches its casts until it exits, and the backward of a cast shared by calls sums their gradients in
    bf16."""
    with autocast:
        return model(input_ids=ids, labels=ids, use_cache=False).loss


def writes_kept(rank: int, world: int, param_dtype: Optional[torch.dtype]) -> dict:
    """Writes outside the optimizer into units of several dtypes, kept as DDP keeps them (each rank writes its whole
    copy; every rank's shard takes its part), each followed by SGD steps; against the plain model with the same writes
    (under bf16 autocast where the units gather in bf16):

    * inside ``keep_gathered(modifier_rank=1)``: rank 1's writes (rank 0 writes others) into an adapter (gathered in
      bf16 under ``param_dtype``: a value bf16 holds, so that the reference's fp32 write is the same), a bf16 base
      weight and a bf16 norm;
    * ``p.data = ...`` on the shard parameters between steps (a momentum teacher's update; their shards then);
    * ``p.data.clamp_()`` on the gathered copies of the root (LoRA on ``lm_head``) inside a step, after its forward,
      where Lightning runs ``on_before_zero_grad`` (fp32 gathers only: under autocast the reference's backward reads
      the bf16 copies its forward made, not the weights clamped since)."""
    targets = ("q_proj", "v_proj", "lm_head")
    reference, model = lora_llama(targets), lora_llama(targets)
    runtime = shard_module(model, units=["LlamaDecoderLayer"], param_dtype=param_dtype)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    runtime.attach_optimizer(optimizer)
    ref_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=param_dtype == torch.bfloat16)

    def write(net, value: float) -> None:
        with torch.no_grad():
            for name, param in net.named_parameters():
                if "layers.0.self_attn.q_proj.lora_A" in name:
                    param[1].fill_(value)
                elif "layers.1.self_attn.v_proj.base_layer" in name or "layers.1.input_layernorm" in name:
                    param.mul_(value)

    with runtime.keep_gathered(modifier_rank=1):
        write(model, 2.0 if rank == 1 else 0.5)
    write(reference, 2.0)
    ids = batches()[0][: 2 * world]
    for _ in range(2):
        for net in (model, reference):  # between steps: a new tensor for each adapter (its shard, sharded)
            for name, param in net.named_parameters():
                if "lora_B" in name:
                    param.data = param.data * 0.5 + 0.01
        mine = ids.chunk(world)[rank]
        # Lightning's order: the forward, then on_before_zero_grad's constraint (the root is gathered: its copies are
        # written), then the backward
        loss = runtime.run_step(lambda: model(input_ids=mine, labels=mine, use_cache=False).loss)
        ref_loss = sum(_loss_under(autocast, reference, chunk) / world for chunk in ids.chunk(world))
        for net in (model, reference) if param_dtype is None else ():
            for name, param in net.named_parameters():
                if "lm_head.lora_A" in name:
                    param.data.clamp_(-CLIP, CLIP)
        loss.backward()
        ref_loss.backward()
        runtime.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
    full, expected = full_state_dict(runtime, rank0_only=False), reference.state_dict()
    return {name: float((full[name].double() - value.double()).abs().max()) for name, value in expected.items()}


def frozen_between_micro_batches(rank: int, world: int, cases: list[tuple[dict, str, str]]) -> list[float]:
    """Per ``(policy, deferral, change)``: two steps of two micro-batches; between them layer 0's ``q_proj`` adapters
    are frozen (``change="freeze"``: plain torch keeps and steps the gradient they got from the first) or unfrozen
    (``"unfreeze"``: frozen for the first), as they were after the step. ``deferral``: ``"all"`` (``no_sync``),
    ``"replicas"`` (``no_replica_sync``), ``""`` (reduced every micro-batch). Reference: one process on the global
    micro-batches (under bf16 autocast where the policy gathers in bf16). The largest adapter difference."""
    differences = []
    for policy, deferral, change in cases:
        reference, model = lora_llama(), lora_llama()
        runtime = shard_module(model, units=["LlamaDecoderLayer"], **policy)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        runtime.attach_optimizer(optimizer)
        ref_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
        autocast = torch.autocast("cpu", torch.bfloat16, enabled=policy.get("param_dtype") == torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        windows = [[torch.randint(0, VOCAB, (world, 8), generator=g) for _ in range(2)] for _ in range(2)]
        for net in (reference, model):
            changed = [p for n, p in net.named_parameters() if "layers.0.self_attn.q_proj.lora_" in n]
            for window in windows:
                for i, ids in enumerate(window):
                    for p in changed:
                        p.requires_grad_((i == 0) == (change == "freeze"))
                    skip = {"all": runtime.no_sync, "replicas": runtime.no_replica_sync}.get(deferral)
                    if net is model:
                        with skip() if skip is not None and i == 0 else contextlib.nullcontext():
                            mine = ids[rank : rank + 1]
                            (model(input_ids=mine, labels=mine, use_cache=False).loss / 2).backward()
                    else:
                        for r in range(world):
                            (_loss_under(autocast, reference, ids[r : r + 1]) / 2 / world).backward()
                runtime.step(optimizer) if net is model else ref_optimizer.step()
                (optimizer if net is model else ref_optimizer).zero_grad(set_to_none=True)
                for p in changed:
                    p.requires_grad_(True)
        full, expected = full_state_dict(runtime, rank0_only=False), reference.state_dict()
        differences.append(max(float((full[k] - v).abs().max()) for k, v in expected.items() if "lora_" in k))
    return differences
