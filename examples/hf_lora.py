"""Fine-tune a Hugging Face model with LoRA under ShardStrategy, end to end: a model folder in, LoRA trained on 2 CPU
processes with the base sharded, the adapter folder out, and the adapter reloaded in one process with peft's
``PeftModel.from_pretrained``, which must give the sharded model's logits.

    python examples/hf_lora.py                                 # a tiny Llama folder made on the fly, nothing downloaded
    python examples/hf_lora.py --base path/to/Llama-3.2-1B --precision bf16-mixed --steps 50 --seq 256

Text: Python's standard-library documentation (``lightning_shard.app.data.text``), tokenized by the folder's
tokenizer, or as bytes where the folder has none. Writes into ``--out`` (default ``outputs/hf_lora``): ``tiny-llama/``
(when made here) and ``adapter/`` (``adapter_config.json``, ``adapter_model.safetensors``); exits with an error where
the check fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_shard import SavePretrained, ShardStrategy, from_pretrained
from lightning_shard.app.data.text import token_ids
from lightning_shard.app.models.tiny_llama import tiny_llama_folder
from lightning_shard.app.quiet import quiet

TOLERANCE = 1e-5  # fp32: equal in practice


class LoraFineTuning(L.LightningModule):
    def __init__(self, base: Path, lr: float) -> None:
        super().__init__()
        self.base, self.lr, self.model = base, lr, None

    def configure_model(self) -> None:  # under ShardStrategy on the meta device: no rank holds the whole base
        if self.model is None:
            from peft import LoraConfig, get_peft_model

            model = from_pretrained(self.base)  # built as transformers builds it; loaded by slices once sharded
            lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            # train mode: from_pretrained returns the model in eval mode, and Lightning keeps each module's mode
            self.model = get_peft_model(model, lora).train()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=None, help="a Hugging Face causal-LM folder (default: a tiny"
                        " Llama made in --out)")
    parser.add_argument("--out", type=Path, default=Path("outputs/hf_lora"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--perturb-reference", type=float, default=0.0, metavar="EPS",
                        help="offset the one-process reference's adapter by EPS: a test that the check fails")
    args = parser.parse_args()
    quiet()  # third-party notes about their own code (each rank runs this script)
    torch.set_num_threads(1)  # one core per process
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.base or tiny_llama_folder(args.out / "tiny-llama")
    L.seed_everything(0, verbose=False)
    module = LoraFineTuning(base, args.lr)
    from transformers import AutoConfig

    ids = token_ids(base, AutoConfig.from_pretrained(base).vocab_size)
    windows = ids[: len(ids) // args.seq * args.seq].view(-1, args.seq)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, precision=args.precision, max_epochs=1, limit_train_batches=args.steps,
        strategy=ShardStrategy(save_frozen=False),  # checkpoints would hold the adapter, not the base
        callbacks=[SavePretrained(args.out / "adapter")],  # the adapter folder, at the end of fit
        logger=False, enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=10,
    )
    trainer.fit(module, DataLoader(windows, batch_size=args.batch, shuffle=True, drop_last=True))

    # logits of the sharded model: every rank calls it (each unit is gathered once, inside keep_gathered)
    probe = windows[:2, :32]
    with torch.no_grad(), trainer.strategy.keep_gathered(), trainer.precision_plugin.forward_context():
        sharded = module.model(input_ids=probe, use_cache=False).logits.float()
    if trainer.global_rank == 0:  # the adapter folder in one process, with peft's own loader
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), args.out / "adapter").eval()
        if args.perturb_reference:  # a test of the check itself: it must fail now
            with torch.no_grad():
                next(p for n, p in reloaded.named_parameters() if "lora_B" in n).add_(args.perturb_reference)
        with torch.no_grad():
            one_process = reloaded(input_ids=probe, use_cache=False).logits.float()
        difference = float((one_process - sharded).abs().max())
        files = ", ".join(sorted(p.name for p in (args.out / "adapter").iterdir()))
        print(f"adapter: {args.out / 'adapter'} ({files})")
        rounding = "" if args.precision == "32-true" else f" ({args.precision}: the sharded forward rounds in bf16)"
        print(f"PeftModel.from_pretrained in one process against the sharded model: max |logits difference|"
              f" {difference:.2e}{rounding}")
        if args.precision == "32-true" and not difference <= TOLERANCE:  # elsewhere the sharded forward rounds in bf16
            raise SystemExit(f"the reloaded adapter's logits differ by {difference:.2e} (more than {TOLERANCE:g})")


if __name__ == "__main__":
    main()
