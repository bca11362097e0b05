"""Scenarios for test_from_pretrained.py, run inside a gloo world: ``lightning_shard.from_pretrained`` on the meta
device, sharded, loaded, against transformers' ``from_pretrained`` in one process (and peft's
``prepare_model_for_kbit_training`` after either), bit for bit."""

from __future__ import annotations

import warnings

import torch

from lightning_shard.checkpoint.full import full_state_dict
from tests.qlora_scenarios import bits

VOCAB = 96


def configs() -> dict:
    """Tiny random models of three families: Llama (GQA, untied), Qwen2 (biased q/k/v projections) and a Llama
    whose head is tied to its input embedding."""
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return {"llama": LlamaConfig(**shape, tie_word_embeddings=False),
            "qwen2": Qwen2Config(**shape, tie_word_embeddings=False),
            "tied": LlamaConfig(**shape, tie_word_embeddings=True)}


def write_folders(root: str) -> None:
    """Each model saved as ``save_pretrained`` writes it (fp32 files, as a model trained in fp32 is saved)."""
    from transformers import AutoModelForCausalLM

    for i, (name, config) in enumerate(configs().items()):
        torch.manual_seed(i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config)
            with torch.no_grad():  # norms away from 1: a missed rounding or cast shows in them too
                for n, p in model.named_parameters():
                    if "norm" in n:
                        p.add_(torch.randn_like(p) * 0.1)
            model.save_pretrained(f"{root}/{name}")
    with warnings.catch_warnings():  # a pre-quantized folder, as the hub's *-bnb-4bit ones: from_pretrained's bytes
        warnings.simplefilter("ignore")
        case = {"quant": "nf4", "double": True, "dtype": torch.bfloat16}
        AutoModelForCausalLM.from_pretrained(f"{root}/llama", **options(case)).save_pretrained(f"{root}/llama-bnb")


def options(case: dict) -> dict:
    """``from_pretrained``'s keyword arguments for a case ``{"model", "quant" (nf4, fp4 or None), "double",
    "dtype", "compute", "prepare"}``."""
    from transformers import BitsAndBytesConfig

    found = {"dtype": case["dtype"]}
    if case["quant"]:
        found["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=case["quant"], bnb_4bit_use_double_quant=case["double"],
            bnb_4bit_compute_dtype=case.get("compute", torch.bfloat16))
    return found


def _prepared(model, case: dict):
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False) if case["prepare"] else model


def _described(model) -> dict:
    """What from_pretrained decides besides the weights: the dtype and class of every parameter and buffer (the
    non-persistent ones too: Llama's rotary inv_freq), what requires a gradient, the mode, the quantizer's marks."""
    return {"params": {n: (type(p).__name__, str(p.dtype), p.requires_grad) for n, p in model.named_parameters()},
            "buffers": {n: str(b.dtype) for n, b in model.named_buffers()},
            "training": model.training, "loaded_in_4bit": getattr(model, "is_loaded_in_4bit", False),
            "quantized": getattr(model, "is_quantized", False), "config": model.config.to_dict()}


def built_against_from_pretrained(rank: int, world: int, root: str, cases: list[dict]) -> list[dict]:
    """Per case: ``lightning_shard.from_pretrained`` under ``torch.device("meta")`` (as in ``configure_model``),
    ``prepare_model_for_kbit_training`` where the case says, sharded by layers, loaded by ``load_pretrained(model)``
    (the folder it recorded); against transformers' ``from_pretrained`` (and the same preparation) in one process:
    every state-dict entry's bytes (packed weights, absmax, code tables, nested state, the blob with the offset and
    shape), the non-persistent buffers' bytes, what ``_described`` lists, and the logits of a train-mode forward."""
    import lightning_shard
    from lightning_shard.checkpoint.pretrained import load_pretrained
    from lightning_shard.engine.shard_module import shard_module
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    results = []
    for case in cases:
        folder = f"{root}/{case['model']}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                model = _prepared(lightning_shard.from_pretrained(folder, **options(case)), case)
            reference = _prepared(AutoModelForCausalLM.from_pretrained(folder, **options(case)), case)
        runtime = shard_module(model, units=[type(model.model.layers[0]).__name__])
        load_pretrained(model)
        state = full_state_dict(runtime, rank0_only=False)
        expected = reference.state_dict()
        with runtime.keep_gathered(), torch.no_grad():
            described = _described(model)
            buffers = {n: b.clone() for n, b in model.named_buffers()}
            logits = model.train()(input_ids=ids, use_cache=False).logits
        with torch.no_grad():  # train mode: in eval mode bitsandbytes repacks 4-bit weights for CPU inference
            ref_logits = reference.train()(input_ids=ids, use_cache=False).logits
        results.append({
            "case": case, "keys": sorted(state) == sorted(expected), "total": len(expected),
            "differ": [k for k, v in expected.items() if k not in state or not _same(state[k], v)],
            "buffers_differ": [n for n, b in reference.named_buffers() if not _same(buffers.get(n), b)],
            "described": described == _described(reference.eval()),
            "described_diff": _diff(described, _described(reference.eval())),
            "packed": sum(type(p).__name__ == "Params4bit" for p in reference.parameters()),
            "logits": torch.equal(logits, ref_logits), "logits_gap": float((logits - ref_logits).abs().max()),
        })
    return results


def _same(a, b) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _diff(mine: dict, theirs: dict) -> list:
    found = []
    for key in theirs:
        if isinstance(theirs[key], dict):
            found += [(key, k, mine[key].get(k), v) for k, v in theirs[key].items() if mine[key].get(k) != v]
        elif mine[key] != theirs[key]:
            found.append((key, mine[key], theirs[key]))
    return found[:6]
