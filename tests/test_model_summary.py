"""Lightning's model summary of a sharded model counts the parameters as DDP's does: full shapes, frozen ones included
(a gloo world of 2, see world.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


def _summaries(rank: int, world: int) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    from lightning_shard.engine.shard_module import shard_module
    from lightning_shard.lightning.summary import summarize_in_full_shapes

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(9, 31), nn.ReLU(), nn.Linear(31, 5))
            self.frozen = nn.Linear(5, 3).requires_grad_(False)
            self.example_input_array = torch.randn(2, 9)  # the summary's forward runs on the sharded model

        def forward(self, x):
            return self.frozen(self.net(x))

    torch.manual_seed(0)
    plain = Lit()
    lit = copy.deepcopy(plain)
    runtime = shard_module(lit, unit_size=100)
    trainer = SimpleNamespace(strategy=SimpleNamespace(runtime=runtime))
    out = {}
    for kind in (ModelSummary, RichModelSummary):
        callback = kind(max_depth=2)
        summarize_in_full_shapes([callback])
        summarize_in_full_shapes([callback])  # a second Trainer's setup: wrapped once
        for name, model, on in (("plain", plain, SimpleNamespace(strategy=SimpleNamespace())), ("sharded", lit, trainer)):
            summary = callback._summary(on, model)
            out[f"{kind.__name__} {name}"] = (summary._get_summary_data(), summary.total_parameters,
                                             summary.trainable_parameters, summary.model_size)
    out["sharded shard sizes"] = [p.numel() for p in lit.parameters()]  # after the summary: shards again
    return out


def test_the_summary_counts_full_parameters_and_the_model_stays_sharded():
    results = run_world(_summaries, 2, timeout=240)
    for rank_result in results:
        for kind in ("ModelSummary", "RichModelSummary"):
            data, total, trainable, size = rank_result[f"{kind} sharded"]
            assert (data, total, trainable, size) == rank_result[f"{kind} plain"]
            assert (total, trainable) == (9 * 31 + 31 + 31 * 5 + 5 + 5 * 3 + 3, 9 * 31 + 31 + 31 * 5 + 5)
            assert dict(data)["In sizes"][0] == "[2, 9]"  # the example input ran through the sharded model
        assert sum(rank_result["sharded shard sizes"]) < 9 * 31
