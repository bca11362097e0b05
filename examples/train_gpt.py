"""ShardStrategy from plain Python (no Hydra): a small character-level GPT on 2 CPU processes.

    python examples/train_gpt.py                      # full sharding, 2 processes, 150 steps
    python examples/train_gpt.py --sharding grad_op --devices 3 --unit-size 200000
    python examples/train_gpt.py --sharding hybrid --devices 4 --shard-size 2   # 2 replicas of 2-rank groups
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from lightning_shard import ShardStrategy
from lightning_shard.app.callbacks import PrintProgress
from lightning_shard.app.data.text import CharTextDataModule
from lightning_shard.app.models.gpt import GPT
from lightning_shard.app.models.lit_lm import LitLanguageModel
from lightning_shard.app.quiet import quiet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--sharding", default="full", choices=["full", "grad_op", "hybrid", "none"])
    parser.add_argument("--shard-size", type=int, default=None, help="hybrid: ranks per shard group (default: --devices)")
    parser.add_argument("--unit-size", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    quiet()  # Lightning's notes about its own code (each rank runs this script)
    torch.set_num_threads(1)  # one core per process
    L.seed_everything(0)
    data = CharTextDataModule(seq_len=args.seq, batch_size=args.batch)
    model = LitLanguageModel(GPT(data.vocab_size, width=args.width, depth=args.depth, heads=4, max_seq=args.seq))
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.max_steps,
        strategy=ShardStrategy(sharding=args.sharding, unit_size=args.unit_size,
                               shard_size=args.shard_size if args.sharding == "hybrid" else None),
        limit_val_batches=20, val_check_interval=args.max_steps, check_val_every_n_epoch=None,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[PrintProgress(every=10)],
    )
    trainer.fit(model, data)

    # the trained model's logits, its units held gathered for the loop: every rank runs it (greedy, 60 characters)
    ids = torch.tensor([[data.vocab.index(ch) for ch in "The "]])
    with torch.no_grad(), trainer.strategy.keep_gathered():
        for _ in range(60):
            logits = model.model(ids[:, -args.seq:])
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    if trainer.global_rank == 0:
        print("sample:", repr("".join(data.vocab[i] for i in ids[0].tolist())))


if __name__ == "__main__":
    main()
