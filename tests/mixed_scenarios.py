"""Scenarios for test_mixed_dtypes.py (issue 48), run inside a gloo world: units whose parameters differ in dtype,
as Hugging Face's usual LoRA recipe makes them (a base loaded in bf16, peft's adapters in fp32), trained through
Lightning under ShardStrategy and under DDP on the same per-rank batches."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from lightning_shard.checkpoint.full import full_state_dict
from tests.world import as_lightning_rank

VOCAB = 96
GLOBAL_BATCH = 6  # split evenly over 2 and 3 ranks
STEPS = 5


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


def write_base(folder: str) -> None:
    """A tiny Llama folder as save_pretrained writes it (fp32), built here: nothing is downloaded."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM(llama_config()).save_pretrained(folder)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, 12), generator=g) for _ in range(STEPS)]


def _lora_module():
    import lightning as L

    class LoraModule(L.LightningModule):
        """The standard recipe: ``from_pretrained(dtype=torch.bfloat16)``, then peft's LoRA (adapters in fp32, peft's
        ``autocast_adapter_dtype`` default)."""

        def __init__(self, base: str, chunk: slice) -> None:
            super().__init__()
            from peft import LoraConfig, get_peft_model
            from transformers import LlamaForCausalLM

            model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            torch.manual_seed(1)
            # nonzero B (peft's default starts it at 0): every adapter matrix moves from the first step
            config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                init_lora_weights="gaussian")
            self.model, self.chunk = get_peft_model(model, config), chunk
            self.losses: list[float] = []

        def training_step(self, batch, _):
            ids = batch[self.chunk]
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
            self.losses.append(float(self.all_gather(loss.detach().float()).mean()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    return L, LoraModule


def _fit(base: str, rank: int, world: int, strategy, precision: str):
    L, LoraModule = _lora_module()
    size = GLOBAL_BATCH // world
    module = LoraModule(base, slice(rank * size, (rank + 1) * size))
    data = torch.utils.data.DataLoader(batches(), batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=precision, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, use_distributed_sampler=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return module, trainer


def lora_against_ddp(rank: int, world: int, base: str, precisions: list[str]) -> list[dict]:
    """Per precision: the losses and adapter weights of ShardStrategy and of DDP, and what the sharded run held."""
    from lightning_shard import ShardStrategy

    as_lightning_rank(rank, world)
    results = []
    for precision in precisions:
        sharded, trainer = _fit(base, rank, world, ShardStrategy(units=["LlamaDecoderLayer"]), precision)
        runtime = trainer.strategy.runtime
        full = full_state_dict(runtime, rank0_only=False)
        mixed = [u for u in runtime.units if type(u.storage).__name__ == "MixedShard"]
        # the figures of the last step: per unit, one all-gather in forward and one in backward
        stats = runtime.last_step_stats
        held: dict[tuple[str, bool], int] = {}
        for param in sharded.parameters():
            held[(str(param.dtype), param.requires_grad)] = held.get((str(param.dtype), param.requires_grad), 0) + 1
        stepped = sum(p.numel() for p in sharded.parameters() if p.requires_grad)  # this rank's adapter elements
        state = trainer.optimizers[0].state
        reference, _ = _fit(base, rank, world, "ddp", precision)
        results.append({
            "precision": precision,
            "losses": sharded.losses, "ddp_losses": reference.losses,
            "adapters": {k: v for k, v in full.items() if "lora_" in k},
            "ddp_adapters": {k: v.detach().clone() for k, v in reference.state_dict().items() if "lora_" in k},
            "base": {k: v for k, v in full.items() if "lora_" not in k},
            "ddp_base": {k: v.detach().clone() for k, v in reference.state_dict().items() if "lora_" not in k},
            "held": held, "stepped": stepped,
            "optimizer_dtypes": sorted({str(v.dtype) for s in state.values() for k, v in s.items() if k != "step"}),
            "mixed_units": len(mixed),
            "gather_bytes": [u.storage.gathered_nbytes for u in runtime.units],
            "root": runtime.root_unit.storage.gathered_nbytes if runtime.root_unit is not None else 0,
            "largest_adapter": max(s.numel for u in mixed for s in u.storage.slots if s.requires_grad),
            "reduced_per_rank": [u.storage.grad_shard_layout()[0] for u in mixed],
            "stats": stats,
        })
    dist.barrier()
    return results


def estimate_by_dtype(rank: int, world: int, base: str) -> dict:
    """The estimator's figures for the bf16 + fp32-adapter model, planned before sharding and read off the sharded
    model, beside what the sharded model holds on this rank."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lightning_shard.engine.shard_module import shard_module
    from lightning_shard.memory.estimate import estimate_memory, estimate_sharded

    model = get_peft_model(LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    units = ["LlamaDecoderLayer"]
    planned = estimate_memory(model, world, units=units, param_dtype=torch.bfloat16)
    fp32_everything = sum(p.numel() for p in model.parameters()) * 4 // world
    runtime = shard_module(model, units=units, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    read = estimate_sharded(runtime, "full", 1, torch.optim.AdamW)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    runtime.attach_optimizer(optimizer)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    # the memory behind the gradients: each unit's reduced shard, which the parameters' .grad view
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in model.parameters() if p.grad is not None}
    grads = sum(storages.values())
    runtime.step(optimizer)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    root = runtime.root_unit.storage
    held = sum(u.storage.shard.nbytes for u in runtime.units) + (0 if root.aliases_shard else root.gathered_nbytes)
    return {"planned": planned.as_dict(), "read": read.as_dict(), "held": held, "state": state, "grads": grads,
            "fp32_everything": fp32_everything}


def sharding_modes(rank: int, world: int, cases: list[tuple[str, int]]) -> list[float]:
    """Per case ``(sharding, micro-batches per step)``: a bf16 Llama with fp32 LoRA adapters, 3 steps, against one
    process accumulating the ranks' micro-batches; the largest adapter difference after them."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lightning_shard.engine.shard_module import shard_module

    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config()).to(torch.bfloat16)
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))

    differences = []
    for sharding, accumulate in cases:
        reference, model = build(), build()
        runtime = shard_module(model, sharding=sharding, units=["LlamaDecoderLayer"],
                               shard_size=2 if sharding == "hybrid" else None)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        runtime.attach_optimizer(optimizer)
        ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for micro in range(accumulate):
                ids = torch.randint(0, VOCAB, (world, 8), generator=g)
                last = micro == accumulate - 1
                with runtime.no_replica_sync() if not last and sharding == "hybrid" else contextlib.nullcontext():
                    (model(input_ids=ids[rank : rank + 1], labels=ids[rank : rank + 1]).loss / accumulate).backward()
                for r in range(world):
                    (reference(input_ids=ids[r : r + 1], labels=ids[r : r + 1]).loss / accumulate / world).backward()
            runtime.step(optimizer)
            optimizer.zero_grad()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        full, expected = full_state_dict(runtime, rank0_only=False), reference.state_dict()
        differences.append(max(float((full[k] - v).abs().max()) for k, v in expected.items() if "lora_" in k))
    return differences
