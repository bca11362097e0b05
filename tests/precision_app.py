"""Trains the character GPT on real text under each precision (2 CPU ranks, full sharding) and saves
losses, dtypes and communication figures for test_precision_lightning.py."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_shard import MixedPrecision, ShardStrategy  # noqa: E402
from lightning_shard.app.data.text import CharTextDataModule  # noqa: E402
from lightning_shard.app.models.gpt import GPT  # noqa: E402
from lightning_shard.app.models.lit_lm import LitLanguageModel  # noqa: E402

RUNS = {
    "32-true": ("32-true", None),
    "bf16-mixed": ("bf16-mixed", None),
    "bf16-true": ("bf16-true", None),
    "custom": ("32-true", MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
}


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.dtypes: dict[str, str] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(pl_module.all_gather(outputs["loss"].detach().float()).mean().item())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.dtypes["master"] = str(params[0].dtype)
        self.dtypes["grad"] = str(next(p.grad.dtype for p in params if p.grad is not None))


def main(out: str, steps: int = 50) -> None:
    torch.set_num_threads(1)  # deterministic CPU reductions: the comparison is then reproducible
    results = {}
    for name, (precision, policy) in RUNS.items():
        L.seed_everything(0)
        data = CharTextDataModule(seq_len=64, batch_size=8)
        module = LitLanguageModel(GPT(data.vocab_size, width=64, depth=2, heads=4, max_seq=64), lr=3e-3)
        record = Record()
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=ShardStrategy(mixed_precision=policy), precision=precision,
            max_steps=steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        )
        trainer.fit(module, data)
        optimizer = trainer.optimizers[0]
        state_dtypes = sorted({str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"})
        ckpt = os.path.join(out, f"{name}.ckpt")
        trainer.save_checkpoint(ckpt)
        results[name] = {"losses": record.losses, **record.dtypes, "optimizer_state": state_dtypes,
                         "comm": trainer.strategy.comm_stats,
                         "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters())}
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(results, os.path.join(out, "precision.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
