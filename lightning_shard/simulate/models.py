"""The simulator's model presets, each at its real shapes (nothing downloaded: built from a config), and the
selective activation checkpointing torchtitan's Llama-3.1-8B benchmark used.

``layers`` (a preset's own, or ``--layers``) may be fewer than the model has (``full_layers``): the 70B shape runs a
few of its 80 layers and the command scales the per-layer figures to 80 (command.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_shard.app.models.gpt import GPT


@dataclass(frozen=True)
class ModelPreset:
    name: str
    what: str
    kind: str  # "gpt" (the repository's GPT) or "llama" (transformers' LlamaForCausalLM)
    width: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int
    batch: int  # local (per rank) batch, sequences
    checkpoint: bool = False  # torchtitan's selective activation checkpointing ("op"), per layer
    full_layers: Optional[int] = None  # the real model's layers, where fewer run (scaled)
    rope_theta: float = 10000.0


MODELS = {p.name: p for p in (
    ModelPreset("gpt-small", "the repository's GPT, 6 blocks of width 512 (the CPU default)", "gpt", 512, 6, 8, 8,
                2048, 12000, 128, 8),
    ModelPreset("gpt-184m", "the repository's GPT of the step benchmark, 184M: 12 blocks of width 1024", "gpt", 1024, 12,
                16, 16, 4096, 32000, 512, 8),
    ModelPreset("llama-840m", "HF LlamaForCausalLM 840M of the step benchmark: 16 layers, hidden 2048, 4 KV heads",
                "llama", 2048, 16, 16, 4, 5504, 32000, 1024, 4),
    ModelPreset("llama3-8b", "Llama-3.1-8B's shape at torchtitan's benchmark settings (sequence 8192, local batch 2,"
                " selective activation checkpointing)", "llama", 4096, 32, 32, 8, 14336, 128256, 8192, 2,
                checkpoint=True, rope_theta=500000.0),
    ModelPreset("llama3-70b", "Llama-3.1-70B's shape, 4 of its 80 layers run (per-layer figures scaled to 80),"
                " sequence 8192, local batch 1, selective activation checkpointing", "llama", 8192, 4, 64, 8, 28672,
                128256, 8192, 1, checkpoint=True, full_layers=80, rope_theta=500000.0),
)}


class HFCausalLM(nn.Module):
    """An HF causal LM as the simulator calls a model: token ids in, logits out; ``blocks`` its decoder layers."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    @property
    def blocks(self) -> nn.ModuleList:
        return self.hf.model.layers

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx).logits


def build(preset: ModelPreset, layers: int, seq: int) -> nn.Module:
    """The model, on the current default device, with its blocks wrapped in :class:`Checkpointed` where the preset
    checkpoints."""
    if preset.kind == "gpt":
        model: nn.Module = GPT(preset.vocab, preset.width, layers, preset.heads, seq)
    else:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=preset.vocab, hidden_size=preset.width, num_hidden_layers=layers,
            intermediate_size=preset.intermediate, num_attention_heads=preset.heads,
            num_key_value_heads=preset.kv_heads, max_position_embeddings=seq, rope_theta=preset.rope_theta,
            tie_word_embeddings=False, use_cache=False)
        model = HFCausalLM(transformers.LlamaForCausalLM(config))
    if preset.checkpoint:
        blocks = model.blocks
        for i, block in enumerate(blocks):
            blocks[i] = Checkpointed(block)
    return model


def block_class(model: nn.Module) -> type:
    """The class each block is (the unit both strategies shard by)."""
    return type(model.blocks[0])


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a batch of ``seq + 1`` token ids, computed in fp32 (as torchtitan does)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


# torchtitan's "op" selective activation checkpointing: keep the outputs of attention and of every other matmul,
# recompute the rest (torchtitan/distributed/activation_checkpoint.py, _apply_op_sac)
def _saved_ops() -> set:
    names = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention")
    return {torch.ops.aten.mm.default} | {getattr(torch.ops.aten, n).default for n in names
                                           if hasattr(torch.ops.aten, n)}


def _selective_contexts() -> tuple:
    saved, counts = _saved_ops(), {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # type: ignore[no-untyped-def]
        if func == torch.ops.aten.mm.default:
            counts[ctx.is_recompute] += 1
        keep = func in saved and not (func == torch.ops.aten.mm.default and counts[ctx.is_recompute] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Checkpointed(nn.Module):
    """A block whose forward runs under selective activation checkpointing (the same wrapper for both strategies)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return checkpoint(self.layer, *args, use_reentrant=False, context_fn=_selective_contexts,
                          preserve_rng_state=False, **kwargs)


def batches(preset: ModelPreset, batch: int, seq: int, count: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, preset.vocab, (batch, seq + 1), generator=g).to(device) for _ in range(count)]

