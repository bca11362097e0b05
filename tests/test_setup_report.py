"""What the strategy says at setup about memory: by default two lines (the peak per rank before activations, its three
largest parts, where the rest is); every row at DEBUG level. The rows are documented: tests/test_docs.py."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.world import one_rank_here

pytestmark = pytest.mark.timeout(300)


def _fit_logging_setup() -> tuple[list[logging.LogRecord], object]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import ShardStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    trainer = L.Trainer(strategy=ShardStrategy(units=["Linear"]), accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        with one_rank_here():
            trainer.fit(Lit(), DataLoader(TensorDataset(torch.randn(8, 16)), batch_size=4))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return records, trainer.strategy.memory_estimate


def test_the_setup_report_is_two_lines_and_every_row_is_at_debug_level():
    records, estimate = _fit_logging_setup()
    info = [r.getMessage() for r in records
            if r.levelno == logging.INFO and "estimated peak per rank" in r.getMessage()]
    assert len(info) == 1
    lines = info[0].splitlines()
    assert len(lines) == 2, info[0]
    mib = 2**20
    assert f"before activations {estimate.peak / mib:.1f} MiB" in lines[0]
    # the three largest parts of the peak, by the table's row names, largest first
    parts = sorted(estimate.peak_parts().items(), key=lambda kv: -kv[1])[:3]
    assert lines[0].endswith("most of it " + ", ".join(f"{k} {v / mib:.1f}" for k, v in parts) + " MiB"), lines[0]
    assert sum(estimate.peak_parts().values()) == estimate.peak
    assert "DEBUG" in lines[1] and "python -m lightning_shard.estimate" in lines[1] and "docs/memory.md" in lines[1]

    debug = [r.getMessage() for r in records if r.levelno == logging.DEBUG and "every row" in r.getMessage()]
    assert len(debug) == 1
    rows = [line.split()[0] for line in debug[0].splitlines()[1:]]
    assert rows == [name for name in estimate.as_dict() if name != "activations" and not name.startswith("host")]
