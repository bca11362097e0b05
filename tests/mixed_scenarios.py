"""Scenarios for test_mixed_dtypes.py (issue 48), run inside a gloo world: units whose parameters differ in dtype,
as Hugging Face's usual LoRA recipe makes them (a base loaded in bf16, peft's adapters in fp32), trained through
Lightning under ShardStrategy and under DDP on the same per-rank batches."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from torch.utils._pytree import tree_flatten

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.memory.tracker import LiveBytes
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


# -- QLoRA: 4-bit bases (bitsandbytes) -------------------------------------------------------------------------------
QUANT_CASES = [(kind, storage, double) for kind in ("nf4", "fp4") for storage in ("uint8", "bfloat16")
               for double in (True, False)]


def qlora_model(base: str, kind: str, storage: str, double: bool, hf_checkpointing: bool = False):
    """``from_pretrained`` with bitsandbytes' 4-bit quantization on the CPU, prepared for k-bit training (norms and
    embeddings in fp32) and given LoRA adapters: QLoRA as the peft docs write it."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=torch.bfloat16,
                                bnb_4bit_quant_storage=getattr(torch, storage), bnb_4bit_use_double_quant=double)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(base, quantization_config=config, device_map="cpu",
                                                 dtype=torch.bfloat16)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=hf_checkpointing)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                      init_lora_weights="gaussian")
    return get_peft_model(model, lora).train()


def _quant_state(model) -> dict[str, torch.Tensor]:
    """The packed weights and their quantization state, as bitsandbytes writes them into a state dict."""
    return {k: v.clone() for k, v in model.state_dict().items() if ".base_layer." in k or "_proj.weight" in k}


def _one_process_step(model, optimizer, ids: torch.Tensor, world: int) -> float:
    """One process's step on the global batch, its gradient the mean of the per-rank chunks' (the global loss's: the
    chunks are equally long): each chunk's forward and backward as a rank runs it. bitsandbytes computes in bf16, and
    its kernels round differently for another number of rows: a forward of all rows at once would differ from the
    ranks' by bf16 roundings that AdamW's normalisation turns into 1e-2 on near-zero gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, losses = [], []
    for chunk in ids.chunk(world):
        loss = model(input_ids=chunk, labels=chunk, use_cache=False).loss
        loss.backward()
        grads.append([p.grad for p in params])
        losses.append(float(loss.detach()))
        for p in params:
            p.grad = None
    for p, *per_chunk in zip(params, *grads):
        total = per_chunk[0] / world
        for grad in per_chunk[1:]:
            total = total + grad / world
        p.grad = total
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sum(losses) / world


def qlora_against_one_process(rank: int, world: int, base: str, cases: list) -> list[dict]:
    """Per case ``(quant type, storage dtype, double quantization)``: 5 AdamW steps of QLoRA sharded over this world
    and in one process on the global batch; losses, adapters, and the packed weights with their quantization state
    (gathered: bitsandbytes' own state-dict entries) of both."""
    from lightning_shard.engine.shard_module import shard_module

    results = []
    size = GLOBAL_BATCH // world
    for kind, storage, double in cases:
        reference, model = qlora_model(base, kind, storage, double), qlora_model(base, kind, storage, double)
        before = _quant_state(reference)
        runtime = shard_module(model, units=["LlamaDecoderLayer"])
        packed = [type(p).__name__ for u in runtime.units for p in u.storage.gathered_params]
        # every parameter given to the optimizer, as a plain `AdamW(model.parameters())` does: the frozen packed ones
        # get no gradient, hence no state and no weight decay
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        runtime.attach_optimizer(optimizer)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        losses, ref_losses = [], []
        for ids in batches():
            mine = ids[rank * size : (rank + 1) * size]
            loss = model(input_ids=mine, labels=mine, use_cache=False).loss
            loss.backward()
            graded = [p.dtype for p in model.parameters() if p.grad is not None]
            runtime.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            ref_losses.append(_one_process_step(reference, ref_optimizer, ids, world))
        everyone = [None] * world
        dist.all_gather_object(everyone, losses)
        full = full_state_dict(runtime, rank0_only=False)
        results.append({
            "case": (kind, storage, double),
            "losses": [sum(rank_losses[i] for rank_losses in everyone) / world for i in range(len(losses))],
            "ref_losses": ref_losses,
            "adapters": {k: v for k, v in full.items() if "lora_" in k},
            "ref_adapters": {k: v.detach().clone() for k, v in reference.state_dict().items() if "lora_" in k},
            "quant": {k: v for k, v in full.items() if k in before}, "quant_keys": sorted(k for k in full if k in before),
            "ref_quant": _quant_state(reference), "before": before,
            "gathered_classes": sorted(set(packed)),
            "stateless": all(p not in optimizer.state for p in model.parameters() if not p.requires_grad),
            "graded": sorted(set(map(str, graded))),
        })
    return results


def _sharded_qlora(base: str, case: tuple, seed: int):
    from lightning_shard.engine.shard_module import shard_module

    torch.manual_seed(seed)
    model = qlora_model(base, *case)
    if seed:  # another start: adapters, and packed weights and quantization state overwritten, all to be loaded
        for name, param in model.named_parameters():
            if param.requires_grad:
                torch.nn.init.normal_(param.data)
            elif type(param).__name__ == "Params4bit":
                param.data.view(torch.uint8).fill_(0x3C)
                param.quant_state.absmax.view(torch.uint8).fill_(7)
    runtime = shard_module(model, units=["LlamaDecoderLayer"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    runtime.attach_optimizer(optimizer)
    return model, runtime, optimizer


def _sharded_steps(model, runtime, optimizer, steps: list[torch.Tensor], rank: int, world: int) -> None:
    for ids in steps:
        mine = ids.chunk(world)[rank]
        model(input_ids=mine, labels=mine, use_cache=False).loss.backward()
        runtime.step(optimizer)
        optimizer.zero_grad(set_to_none=True)


def qlora_save(rank: int, world: int, base: str, case: tuple, path: str) -> dict:
    """3 steps of QLoRA on this world, then a sharded checkpoint; the full state saved."""
    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.io import save_sharded

    model, runtime, optimizer = _sharded_qlora(base, case, seed=0)
    _sharded_steps(model, runtime, optimizer, batches()[:3], rank, world)
    save_sharded({"state_dict": sharded.model_state(runtime),
                  "optimizer_states": [sharded.optimizer_state(runtime, optimizer)]}, Path(path))
    return full_state_dict(runtime, rank0_only=False)


def qlora_resume(rank: int, world: int, base: str, case: tuple, path: str, saved_world: int) -> dict:
    """Another start (adapters, packed weights and quantization state all overwritten) resumed from the checkpoint on
    this world, 2 more steps; and one process doing the same 5 steps uninterrupted (``saved_world`` chunks, then this
    world's), on rank 0."""
    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.io import open_checkpoint

    model, runtime, optimizer = _sharded_qlora(base, case, seed=5)
    checkpoint = open_checkpoint(Path(path))
    source = checkpoint["state_dict"]
    sharded.load_model_state(runtime, source.directory, source.metadata)
    sharded.load_optimizer_state(runtime, optimizer, 0, checkpoint["optimizer_states"][0], source.directory,
                                 source.metadata)
    loaded = full_state_dict(runtime, rank0_only=False)
    _sharded_steps(model, runtime, optimizer, batches()[3:], rank, world)
    resumed = full_state_dict(runtime, rank0_only=False)
    if rank:
        return {}
    reference = qlora_model(base, *case)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step, ids in enumerate(batches()):
        _one_process_step(reference, ref_optimizer, ids, saved_world if step < 3 else world)
    return {"loaded": loaded, "resumed": resumed, "reference": {k: v.detach().clone()
                                                                for k, v in reference.state_dict().items()}}


# -- 4-bit models built on the meta device, loaded by parts ----------------------------------------------------------
def quantization_config(kind: str, storage: str, double: bool):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_quant_storage=getattr(torch, storage), bnb_4bit_use_double_quant=double)


def write_prequantized(base: str, folder: str, case: tuple) -> None:
    """A pre-quantized folder as the hub's ``*-bnb-4bit`` models are (from_pretrained quantizing, save_pretrained)."""
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM.from_pretrained(base, quantization_config=quantization_config(*case), device_map="cpu",
                                         dtype=torch.bfloat16).save_pretrained(folder)


def load_by_parts(rank: int, world: int, base: str, cases: list) -> list[dict]:
    """Per case ``(quant type, storage, double quantization, folder to load or None for ``base``, peft)``: a 4-bit
    Llama built on the meta device (transformers' ``replace_with_bnb_linear``, the head left unquantized as
    from_pretrained leaves it), sharded, then ``load_pretrained``; its full state against from_pretrained quantizing
    ``base`` in one process, and the rank's peak of live tensors while loading."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    from lightning_shard.checkpoint.pretrained import load_pretrained
    from lightning_shard.engine.shard_module import shard_module

    results = []
    for kind, storage, double, folder, lora in cases:
        config = quantization_config(kind, storage, double)
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config())
        model = replace_with_bnb_linear(model, quantization_config=config, modules_to_not_convert=["lm_head"])
        model = model.to(torch.bfloat16)  # (on meta: the dtype its 4-bit weights dequantize to, as from_pretrained's)
        if lora:
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        runtime = shard_module(model, units=["LlamaDecoderLayer"])
        held = sum(u.storage.shard.nbytes for u in runtime.units)
        with NewBytes() as live:
            load_pretrained(model, folder or base)
        full = full_state_dict(runtime, rank0_only=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = LlamaForCausalLM.from_pretrained(base, quantization_config=config, device_map="cpu",
                                                         dtype=torch.bfloat16).state_dict()
        prefix = "base_model.model." if lora else ""
        mine = {k[len(prefix):].replace(".base_layer.", "."): v for k, v in full.items() if "lora_" not in k}
        results.append({"keys": sorted(mine) == sorted(reference), "peak": live.peak, "held": held,
                        "same": [k for k, v in reference.items() if _same_bits(mine.get(k), v)],
                        "total": len(reference)})
    return results


def _same_bits(a, b) -> bool:
    if a is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    size = a.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


class NewBytes(LiveBytes):
    """Tensors allocated while it is on, at their peak: new storages only, not views of storages that existed (a rank's
    shards, written in place; the weights files, memory-mapped, of which a read touches only its slice), nor meta
    tensors (the names and shapes the load hooks see)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.set_:  # a tensor over a storage that exists (a mapped file's)
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                  and t.layout == torch.strided}
        for tensor in tree_flatten(out)[0]:
            if (isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and not tensor.is_meta
                    and tensor.untyped_storage().data_ptr() not in inputs and tensor._base is None):
                self._add(tensor)
        self._sample()
        return out


def qlora_export(rank: int, world: int, base: str, out: str, case: tuple) -> dict:
    """QLoRA trained 3 steps sharded, then exported: the adapter (``PeftModel.from_pretrained`` onto a 4-bit base in
    one process), and merged (4-bit weights dequantized, the adapter merged in, bf16 files) for ``from_pretrained``;
    against peft in one process: the base dequantized (transformers' ``dequantize()``), the exported adapter loaded
    onto it, ``merge_and_unload()``. Rank 0's logits and weights."""
    from peft import PeftModel, prepare_model_for_kbit_training
    from transformers import LlamaForCausalLM

    from lightning_shard.checkpoint.export import save_pretrained

    model, runtime, optimizer = _sharded_qlora(base, case, seed=0)
    _sharded_steps(model, runtime, optimizer, batches()[:3], rank, world)
    ids = batches()[3][:2]
    with runtime.keep_gathered(), torch.no_grad():
        sharded = model(input_ids=ids, use_cache=False).logits
    save_pretrained(model, Path(out) / "adapter")
    save_pretrained(model, Path(out) / "merged", merged=True, dtype=torch.bfloat16)
    if rank:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        four_bit = prepare_model_for_kbit_training(LlamaForCausalLM.from_pretrained(
            base, quantization_config=quantization_config(*case), device_map="cpu", dtype=torch.bfloat16),
            use_gradient_checkpointing=False)  # (as trained: norms and embeddings in fp32)
        # (train mode, no dropout here: bitsandbytes repacks 4-bit weights for CPU inference in eval mode, which
        # fails on layers narrower than a block, as these are)
        adapted = PeftModel.from_pretrained(four_bit, Path(out) / "adapter").train()
        reference = LlamaForCausalLM.from_pretrained(base, quantization_config=quantization_config(*case),
                                                     device_map="cpu", dtype=torch.bfloat16)
        reference.dequantize()
        reference = PeftModel.from_pretrained(reference, Path(out) / "adapter").merge_and_unload().eval()
        merged = LlamaForCausalLM.from_pretrained(Path(out) / "merged").eval()
    with torch.no_grad():
        logits = {"adapter": adapted(input_ids=ids).logits, "merged": merged(input_ids=ids).logits,
                  "reference": reference(input_ids=ids).logits}
    weights = merged.state_dict()
    return {"sharded": sharded, **logits, "config": json.loads((Path(out) / "merged" / "config.json").read_text()),
            "differ": [k for k, v in reference.state_dict().items() if not torch.equal(weights[k], v.to(weights[k].dtype))],
            "dtypes": sorted({str(v.dtype) for v in weights.values()}), "total": len(weights)}


def qlora_checkpointing(rank: int, world: int, base: str) -> dict:
    """3 steps of sharded QLoRA without checkpointing, with HF's (``prepare_model_for_kbit_training``) and with
    ``activation_checkpointing=True``: the losses and adapters of each."""
    from lightning_shard.engine.shard_module import shard_module

    results = {}
    for name in ("none", "hf", "units"):
        torch.manual_seed(0)
        model = qlora_model(base, "nf4", "uint8", True, hf_checkpointing=name == "hf")
        runtime = shard_module(model, units=["LlamaDecoderLayer"], activation_checkpointing=name == "units")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        runtime.attach_optimizer(optimizer)
        losses = []
        for ids in batches()[:3]:
            mine = ids.chunk(world)[rank]
            loss = model(input_ids=mine, labels=mine, use_cache=False).loss
            loss.backward()
            runtime.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        full = full_state_dict(runtime, rank0_only=False)
        results[name] = {"losses": losses, "adapters": {k: v for k, v in full.items() if "lora_" in k},
                         "checkpointed": getattr(model, "is_gradient_checkpointing", False)}
    return results


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
