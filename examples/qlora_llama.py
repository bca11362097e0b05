"""QLoRA with ShardStrategy, checking itself: a Hugging Face causal-LM folder -> a 4-bit base sharded over the ranks ->
LoRA trained on 2 CPU processes -> the adapter folder (and the base with the adapter merged in, bf16) -> the adapter
reloaded by peft in one process, which must give the sharded model's logits.

    python examples/qlora_llama.py                               # a tiny Llama made here, nothing downloaded
    python examples/qlora_llama.py --base path/to/llama --steps 100 --seq 256
    python examples/qlora_llama.py --checkpointing hf            # HF's gradient checkpointing; or: units

``lightning_shard.from_pretrained`` builds the 4-bit base as transformers' ``from_pretrained`` does, on the meta
device: no rank holds the model; ShardStrategy shards it and loads the folder, each rank quantizing only its slices
(bit for bit ``from_pretrained``'s bytes). Text: Python's standard-library documentation, as the folder's tokens (bytes
for the tiny Llama). Writes into ``--out`` (default ``outputs/qlora_llama``): ``tiny-llama/`` (when made here),
``adapter/``, ``merged/`` (as peft's ``merge_and_unload`` on the dequantized base makes it: tests/test_qlora.py) and
``summary.json``; exits with an error where the check fails.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_shard import SavePretrained, ShardStrategy, from_pretrained
from lightning_shard.app.data.text import token_ids
from lightning_shard.app.models.tiny_llama import tiny_llama_folder
from lightning_shard.app.quiet import quiet

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-5  # the same 4-bit kernels on the same bytes: equal in practice


def quantization(args: argparse.Namespace):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quant_type,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=args.double_quant)


class QLoRA(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args, self.model = args, None
        self.losses: list[float] = []

    def configure_model(self) -> None:  # under ShardStrategy, on the meta device: no rank holds the model
        if self.model is None:
            from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

            base = from_pretrained(self.args.base, quantization_config=quantization(self.args), dtype=torch.bfloat16)
            base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=self.args.checkpointing == "hf",
                                                   gradient_checkpointing_kwargs={"use_reentrant": False})
            lora = LoraConfig(r=self.args.rank, lora_alpha=2 * self.args.rank, target_modules=TARGETS, lora_dropout=0.0)
            # train mode: from_pretrained returns the model in eval mode, and Lightning keeps each module's mode
            self.model = get_peft_model(base, lora).train()

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.args.lr)


def reloaded_logits(args: argparse.Namespace, ids: torch.Tensor) -> torch.Tensor:
    """The adapter folder loaded as a user loads it, in this process alone: by peft, onto ``from_pretrained``'s 4-bit
    base prepared for k-bit training as it was trained (embeddings, norms and head in float32)."""
    from peft import PeftModel, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(args.base, quantization_config=quantization(args), dtype=torch.bfloat16)
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    # train mode, as the sharded model ran (no dropout here): PeftModel.from_pretrained returns it in eval mode, in
    # which bitsandbytes repacks 4-bit weights for CPU inference, rounding their quantization state
    adapted = PeftModel.from_pretrained(base, args.out / "adapter").train()
    if args.perturb_reference:  # a test of the check itself: it must fail now
        with torch.no_grad():
            next(p for n, p in adapted.named_parameters() if "lora_B" in n).add_(args.perturb_reference)
    with torch.no_grad():
        return adapted(input_ids=ids, use_cache=False).logits.float()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=None, help="a Hugging Face causal-LM folder (default: a tiny"
                        " Llama made in --out)")
    parser.add_argument("--out", type=Path, default=Path("outputs/qlora_llama"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--quant-type", default="nf4", choices=["nf4", "fp4"])
    parser.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--checkpointing", default="none", choices=["none", "hf", "units"])
    parser.add_argument("--perturb-reference", type=float, default=0.0, metavar="EPS",
                        help="offset the one-process references by EPS: a test that the checks fail")
    args = parser.parse_args(argv)
    quiet()  # third-party notes about their own code (each rank runs this script)
    torch.set_num_threads(1)  # one core per process
    args.out.mkdir(parents=True, exist_ok=True)
    args.base = args.base or tiny_llama_folder(args.out / "tiny-llama", tie_word_embeddings=False)
    L.seed_everything(0, verbose=False)  # the adapters' init (LoRA's A is random) and the shuffle

    from transformers import AutoConfig

    ids = token_ids(args.base, AutoConfig.from_pretrained(args.base).vocab_size)
    windows = ids[: len(ids) // args.seq * args.seq].view(-1, args.seq)
    module = QLoRA(args)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, max_epochs=1,
        strategy=ShardStrategy(units=["LlamaDecoderLayer"], activation_checkpointing=args.checkpointing == "units",
                               save_frozen=False),  # checkpoints would hold the adapter, not the base
        callbacks=[SavePretrained(args.out / "adapter"),  # at the end of fit
                   SavePretrained(args.out / "merged", merged=True, dtype=torch.bfloat16)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(windows, batch_size=args.batch, shuffle=True, drop_last=True))

    # logits of the sharded model, in train mode as it trained: every rank calls it (each unit gathered once)
    probe = windows[:2, :32]
    with torch.no_grad(), trainer.strategy.keep_gathered():
        sharded = module.model.train()(input_ids=probe, use_cache=False).logits.float()
    if trainer.global_rank != 0:
        return
    difference = float((reloaded_logits(args, probe) - sharded).abs().max())
    summary = {"losses": module.losses, "difference": difference, "tolerance": TOLERANCE, "out": str(args.out)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"training loss {module.losses[0]:.4f} -> {module.losses[-1]:.4f} in {len(module.losses)} steps; adapter:"
          f" {args.out / 'adapter'}, merged bf16 model: {args.out / 'merged'}")
    print(f"PeftModel.from_pretrained on from_pretrained's 4-bit base, in one process, against the sharded model:"
          f" max |logits difference| {difference:.2e}")
    if not difference <= TOLERANCE:
        raise SystemExit(f"the reloaded adapter's logits differ by {difference:.2e} (more than {TOLERANCE:g})")


if __name__ == "__main__":
    main()
