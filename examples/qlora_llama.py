"""QLoRA with ShardStrategy: a Hugging Face Llama folder -> a 4-bit base sharded over the ranks -> LoRA -> the adapter
folder -> ``PeftModel.from_pretrained`` in one process.

    python examples/qlora_llama.py                                  # a tiny Llama folder made here, 2 CPU processes
    python examples/qlora_llama.py --base path/to/llama --devices 2 --steps 100 --out qlora-out
    python examples/qlora_llama.py --checkpointing hf               # HF's (prepare_model_for_kbit_training)
    python examples/qlora_llama.py --checkpointing units            # ShardStrategy(activation_checkpointing=True)

The model is built on the meta device with bitsandbytes' 4-bit layers (transformers' ``replace_with_bnb_linear``,
the head left in full precision as ``from_pretrained`` leaves it) and given peft's LoRA adapters; ShardStrategy
shards it without any rank holding it whole, and ``load_pretrained`` then quantizes each rank's part of each weight
of the folder (bit-identical to bitsandbytes quantizing the whole model). A pre-quantized folder (the hub's
``*-bnb-4bit``) loads the same way. At the end rank 0 writes the adapter (``adapter/``) and the base with the
adapter merged in, dequantized, in bf16 (``merged/``), then loads the adapter onto a 4-bit base in one process and
prints how far its logits are from the merged model's; ``summary.json`` holds the figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import lightning as L
import torch

from lightning_shard import SavePretrained, ShardStrategy, load_pretrained

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama_folder(folder: Path) -> Path:
    """A small random Llama as save_pretrained writes it, so that the example runs with nothing downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def quantization(args: argparse.Namespace):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quant_type,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=args.double_quant,
                              bnb_4bit_quant_storage=getattr(torch, args.storage))


class QLoRA(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args, self.model = args, None
        self.losses: list[float] = []

    def configure_model(self) -> None:  # under ShardStrategy, on the meta device: no rank holds the model
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.args.base))
        model = replace_with_bnb_linear(model, quantization_config=quantization(self.args),
                                        modules_to_not_convert=["lm_head"]).to(torch.bfloat16)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=self.args.checkpointing == "hf")
        lora = LoraConfig(r=self.args.rank, lora_alpha=2 * self.args.rank, target_modules=TARGETS, lora_dropout=0.0,
                          task_type="CAUSAL_LM")
        self.model = get_peft_model(model, lora)

    def on_fit_start(self) -> None:
        load_pretrained(self, self.args.base)  # each rank quantizes its part of each weight

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.args.lr)


def batches(vocab: int, steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    """Random tokens, the same on every rank (each rank takes its part through the distributed sampler)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (seq,), generator=g) for _ in range(steps * batch)]


def reload_in_one_process(args: argparse.Namespace, out: Path, ids: torch.Tensor) -> float:
    """``PeftModel.from_pretrained`` of the adapter onto the 4-bit base, against the merged bf16 folder."""
    from peft import PeftModel, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(args.base, quantization_config=quantization(args), device_map="cpu",
                                                dtype=torch.bfloat16)
    adapted = PeftModel.from_pretrained(prepare_model_for_kbit_training(base, use_gradient_checkpointing=False),
                                        out / "adapter").train()  # (eval mode repacks 4-bit weights on some CPUs)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").train()
    with torch.no_grad():
        return float((adapted(input_ids=ids).logits.float() - merged(input_ids=ids).logits.float()).abs().max())


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=None, help="a Hugging Face Llama folder (default: a tiny one)")
    parser.add_argument("--out", type=Path, default=None, help="where the adapter and summary go (default: a temp)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step, all ranks together")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--quant-type", default="nf4", choices=["nf4", "fp4"])
    parser.add_argument("--storage", default="uint8", choices=["uint8", "bfloat16"])
    parser.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--checkpointing", default="none", choices=["none", "hf", "units"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(deprecated|does not have many workers).*")
    torch.set_num_threads(1)  # one core per process
    L.seed_everything(0)  # the adapters' init (LoRA's A is random)
    # the same paths in every process: Lightning's launcher runs this script again for the other ranks, after rank 0
    # has made the folder
    out = args.out or Path(tempfile.gettempdir()) / "qlora-example-out"
    args.base = args.base or Path(tempfile.gettempdir()) / "qlora-example-tiny-llama"
    if not (args.base / "config.json").exists():
        tiny_llama_folder(args.base)

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.base).vocab_size
    module = QLoRA(args)
    strategy = ShardStrategy(units=["LlamaDecoderLayer"], activation_checkpointing=args.checkpointing == "units")
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[SavePretrained(out / "adapter"),
                                                               SavePretrained(out / "merged", merged=True,
                                                                              dtype=torch.bfloat16)])
    data = torch.utils.data.DataLoader(batches(vocab, args.steps, args.batch, args.seq),
                                       batch_size=args.batch // args.devices)
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
        summary = {"losses": module.losses, "out": str(out), "checkpointing": args.checkpointing,
                   "adapter_vs_merged": reload_in_one_process(args, out, ids)}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"losses {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}; adapter in {out / 'adapter'};"
              f" PeftModel.from_pretrained vs the merged bf16 folder: logits within {summary['adapter_vs_merged']:.2e}")


if __name__ == "__main__":
    main()
