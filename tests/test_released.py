"""What a run leaves behind: once the user drops a sharded model (or a Trainer fitted with ShardStrategy), it is freed,
with its optimizer state, as without sharding. A sweep runs its jobs one after another in one process (Hydra's
``-m``); hooks that autograd holds on tensors (from C++, where the garbage collector cannot see them) kept every
earlier job's model alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


def _dropped(rank: int, world: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import ShardStrategy
    from lightning_shard.engine.shard_module import shard_module
    from tests.models import TinyGPT
    from tests.world import as_lightning_rank

    def engine_run() -> weakref.ref:
        model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 1))
        runtime = shard_module(model, units=[nn.Linear])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        runtime.attach_optimizer(optimizer)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        return weakref.ref(model)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyGPT()

        def training_step(self, batch, batch_idx):
            return TinyGPT.loss(self.model, batch[0], batch_idx)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def trainer_run() -> tuple[weakref.ref, weakref.ref]:
        g = torch.Generator().manual_seed(1)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ShardStrategy(units=["Block"]), max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        module = Module()
        trainer.fit(module, DataLoader(TensorDataset(TinyGPT.batch(g, 16)), batch_size=4))
        return weakref.ref(trainer), weakref.ref(module)

    as_lightning_rank(rank, world)
    engine = engine_run()
    trainer, module = trainer_run()
    gc.collect()
    return {"engine model": engine() is None, "trainer": trainer() is None, "module": module() is None}


def test_a_sharded_model_and_a_fitted_trainer_are_freed_once_dropped():
    for report in run_world(_dropped, 2, timeout=240):
        assert all(report.values()), report
