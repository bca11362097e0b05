"""The step benchmark's models: the repository's GPT, or HF ``LlamaForCausalLM`` from a config (GQA, RMSNorm, SwiGLU,
rotary positions; nothing downloaded), in the LightningModule every strategy trains."""

from __future__ import annotations

import torch
from torch import nn

from lightning_shard.app.models.gpt import GPT
from lightning_shard.app.models.lit_lm import LitLanguageModel

MODELS = ("gpt", "hf-llama")
# per model and device: its size and the number of steps (cuda: about 1-2 minutes on one H100 for both precisions;
# hf-llama on cuda: issue 30's 840M Llama, 16 layers, hidden 2048, 4 KV heads, sequence 1024, batch 4)
DEFAULTS = {
    ("gpt", "cpu"): {"depth": 6, "width": 512, "heads": 8, "seq": 128, "batch": 8, "vocab": 12000, "steps": 4,
                     "warmup": 2},
    ("gpt", "cuda"): {"depth": 12, "width": 1024, "heads": 16, "seq": 512, "batch": 8, "vocab": 32000, "steps": 10,
                      "warmup": 3},
    ("hf-llama", "cpu"): {"depth": 4, "width": 512, "heads": 8, "seq": 128, "batch": 8, "vocab": 12000, "steps": 4,
                          "warmup": 2},
    ("hf-llama", "cuda"): {"depth": 16, "width": 2048, "heads": 16, "seq": 1024, "batch": 4, "vocab": 32000,
                           "steps": 10, "warmup": 3},
}


class HFCausalLM(nn.Module):
    """An HF causal LM as the benchmark calls a model: token ids in, logits out; ``blocks`` its decoder layers."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    @property
    def blocks(self) -> nn.ModuleList:  # a property, not a second registration of the same modules
        return self.hf.model.layers

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx).logits


def build_model(args) -> nn.Module:
    """``args.model`` sized by ``args`` (depth, width, heads, seq, vocab)."""
    if args.model == "gpt":
        return GPT(args.vocab, args.width, args.depth, args.heads, args.seq)
    try:
        import transformers
    except ImportError as err:
        raise SystemExit(f"--model hf-llama needs transformers (pip install transformers): {err}") from err
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.depth,
        intermediate_size=(8 * args.width // 3 + 127) // 128 * 128,  # Llama's 8/3 ratio, rounded up to 128
        num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 4), max_position_embeddings=args.seq,
        tie_word_embeddings=False)
    return HFCausalLM(transformers.LlamaForCausalLM(config))


def compile_blocks(model: nn.Module) -> None:
    for block in model.blocks:
        block.compile()


class BenchLM(LitLanguageModel):
    def __init__(self, model: nn.Module, fsdp2: bool = False, optimizer: str = "adamw",
                 compile_blocks: bool = False) -> None:
        super().__init__(model, lr=1e-3, warmup_steps=1)
        self.fsdp2 = fsdp2
        self.compile_blocks = compile_blocks  # by the module itself (lightning_shard compiles through its option)
        self.optimizer = optimizer
        self.automatic_optimization = optimizer == "adamw"

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return super().configure_optimizers()
        return muon_and_adamw(self)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        for optimizer in self.optimizers():
            optimizer.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
        return loss.detach()

    def configure_model(self) -> None:
        if self.compile_blocks:
            compile_blocks(self.model)
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)


def muon_and_adamw(module: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon for the blocks' matrices, AdamW for embeddings, the head, norms and biases."""
    in_blocks = {id(p) for p in module.model.blocks.parameters()}
    named = list(module.named_parameters())
    hidden = [p for _, p in named if p.ndim == 2 and id(p) in in_blocks]
    rest = [p for _, p in named if not (p.ndim == 2 and id(p) in in_blocks)]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.0)]
