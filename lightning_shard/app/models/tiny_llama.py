"""A tiny random Llama saved as ``save_pretrained`` saves it, for the Hugging Face examples to run with nothing
downloaded: 2 layers, hidden 64, GQA, a byte vocabulary."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def tiny_llama_folder(folder: Path, tie_word_embeddings: bool = True) -> Path:
    """``folder`` holding the tiny Llama, made unless it already holds this very model (same config, same seed: the
    same weights); a folder of another config is replaced. Written beside and moved into place: the Trainer's other
    ranks, which run the script again, find it whole."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie_word_embeddings)
    if (folder / "config.json").is_file() and _same(json.loads((folder / "config.json").read_text()), config):
        return folder
    torch.manual_seed(0)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return folder


def _same(saved: dict, config) -> bool:
    ours = config.to_dict()
    return all(saved.get(key) == ours[key] for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "num_attention_heads",
                                                        "num_key_value_heads", "tie_word_embeddings"))
