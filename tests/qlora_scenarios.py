"""Scenarios for test_qlora.py (issue 48), run inside a gloo world: QLoRA, bitsandbytes 4-bit bases with peft's LoRA,
sharded against one process on the global batch; checkpoints, loading by parts, exports, checkpointing."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.memory.tracker import LiveBytes
from tests.mixed_scenarios import GLOBAL_BATCH, batches, llama_config

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
            "quant": {k: v for k, v in full.items() if k in before},
            "quant_keys": sorted(k for k in full if k in before),
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


def resumed_qlora(rank: int, world: int, base: str, case: tuple, path: str) -> tuple[dict, dict]:
    """Another start (adapters, packed weights and quantization state all overwritten) loaded from the sharded
    checkpoint at ``path``, then 2 more steps on this world: the full state loaded, and after."""
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
    return loaded, full_state_dict(runtime, rank0_only=False)


def qlora_resume(rank: int, world: int, base: str, case: tuple, path: str, saved_world: int) -> dict:
    """Another start (adapters, packed weights and quantization state all overwritten) resumed from the checkpoint on
    this world, 2 more steps; and one process doing the same 5 steps uninterrupted (``saved_world`` chunks, then this
    world's), on rank 0."""
    loaded, resumed = resumed_qlora(rank, world, base, case, path)
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
                        "same": [k for k, v in reference.items() if same_bits(mine.get(k), v)],
                        "total": len(reference)})
    return results


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: packed 4-bit values stored as bf16 include NaN patterns, which torch.equal
    calls unequal to themselves."""
    return tensor.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        tensor.element_size()])


def same_bits(a, b) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


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
            "differ": [k for k, v in reference.state_dict().items()
                       if not torch.equal(weights[k], v.to(weights[k].dtype))],
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
