"""Scenarios for test_moe_folders.py, run inside a gloo world: Hugging Face MoE folders (one tensor per expert in the
files, fused experts in transformers 5's models) loaded into sharded models and exported back."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from lightning_shard.checkpoint.export import save_pretrained
from lightning_shard.checkpoint.pretrained import load_pretrained
from lightning_shard.engine.shard_module import shard_module

VOCAB = 96


def model_class(kind: str):
    import transformers

    return getattr(transformers, {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                  "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}[kind])


def config(kind: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2, attn_implementation="eager")
    if kind == "mixtral":
        return transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, **common)
    if kind == "qwen3_vl_moe":  # experts fused in its files too, a transpose where their shapes differ: down_proj square
        text = dict(common, intermediate_size=24, moe_intermediate_size=16, num_experts=4, head_dim=4,
                    rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 0]})
        return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=16, deepstack_visual_indexes=[0]))
    return transformers.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=20, num_experts=5, head_dim=8,
                                       norm_topk_prob=True, **common)


def write_folder(kind: str, folder: str) -> None:
    """The model as its own ``save_pretrained`` writes it: per-expert tensors, over several files."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_class(kind)(config(kind)).save_pretrained(folder, max_shard_size="20KB")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    return found


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _train(model: nn.Module, rank: int, world: int, rows: int = 0) -> None:
    """Three AdamW steps on this rank's part of a global batch of ``rows`` (2 per rank)."""
    g = torch.Generator().manual_seed(5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (rows or 2 * world, 12), generator=g).chunk(world)[rank]
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def round_trip(rank: int, world: int, kind: str, folder: str, out: str) -> dict:
    """The folder into a sharded model (its values, not this rank's own), exported at once (the same files, bit for
    bit), trained and exported again (``from_pretrained`` gives the sharded model's logits), and a LoRA merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    report: dict = {}
    folder, out = Path(folder), Path(out)
    torch.manual_seed(100 + rank)
    model = model_class(kind)(config(kind))
    shard_module(model, unit_size=3000)  # units cut inside layers: a fused tensor's shard ends inside an expert
    report["loaded_keys"] = load_pretrained(model, folder)
    loaded = _logits(model)
    save_pretrained(model, out / "as_loaded", max_shard_size="20KB")
    _train(model, rank, world)
    trained = _logits(model)
    save_pretrained(model, out / "trained")
    torch.manual_seed(200 + rank)
    adapted = get_peft_model(model_class(kind)(config(kind)),
                             LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], lora_dropout=0.0))
    shard_module(adapted)
    load_pretrained(adapted, folder)  # the base's weights, converted, into peft's names
    _train(adapted, rank, world)
    merged = _logits(adapted)
    save_pretrained(adapted, out / "merged", merged=True)
    if rank == 0:
        original, exported = tensors(folder), tensors(out / "as_loaded")
        report["same_names"] = sorted(original) == sorted(exported)
        report["largest_difference"] = max(float((original[k] - exported[k]).abs().max()) for k in original)
        reference = AutoModelForCausalLM.from_pretrained(folder)
        report["loaded"] = float((loaded - _logits(reference)).abs().max())
        report["trained"] = float((trained - _logits(AutoModelForCausalLM.from_pretrained(out / "trained"))).abs().max())
        report["trained_names"] = sorted(tensors(out / "trained")) == sorted(original)
        report["merged"] = float((merged - _logits(AutoModelForCausalLM.from_pretrained(out / "merged"))).abs().max())
        report["merged_names"] = sorted(tensors(out / "merged")) == sorted(original)
    dist.barrier()
    return report


def load_and_export(rank: int, world: int, kind: str, folder: str, out: str) -> tuple:
    """The folder into a sharded model and straight out again: what load_pretrained returned."""
    torch.manual_seed(100 + rank)
    model = model_class(kind)(config(kind))
    shard_module(model, unit_size=3000)
    loaded = load_pretrained(model, folder)
    save_pretrained(model, out)
    return loaded


def missing_expert(rank: int, world: int, folder: str) -> str:
    model = model_class("mixtral")(config("mixtral"))
    shard_module(model)
    try:
        load_pretrained(model, folder)
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        return f"{type(err).__name__}: {err}"
    return "loaded"


def lora_on_experts(rank: int, world: int, folder: str, out: str, unit_size: Optional[int]) -> dict:
    """LoRA on the fused experts (peft's ``target_parameters``, which re-parametrizes them at every forward), a unit
    per layer or units cut inside the layers: trained against one process on the global batch, its adapter
    exported, and merged."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def adapted(model: nn.Module) -> nn.Module:
        torch.manual_seed(7)  # the same adapter's start everywhere
        return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj"],
                                                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = adapted(AutoModelForCausalLM.from_pretrained(folder))
        torch.manual_seed(100 + rank)
        model = adapted(model_class("mixtral")(config("mixtral")))
    shard_module(model, unit_size=unit_size)
    report = {"loaded_keys": load_pretrained(model, folder)}
    _train(model, rank, world)
    _train(reference, 0, 1, rows=2 * world)  # the global batch in one process
    report["against_one_process"] = float((_logits(model) - _logits(reference)).abs().max())
    save_pretrained(model, Path(out) / "adapter")
    save_pretrained(model, Path(out) / "merged", merged=True)  # the hub's layout, each wrapper's delta added
    if rank == 0:
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), Path(out) / "adapter")
        report["adapter"] = float((_logits(reloaded) - _logits(reference)).abs().max())
        merged = AutoModelForCausalLM.from_pretrained(Path(out) / "merged")
        report["merged"] = float((_logits(merged) - _logits(reference)).abs().max())
        report["merged_names"] = sorted(tensors(Path(out) / "merged")) == sorted(tensors(Path(folder)))
    dist.barrier()
    return report
