"""What the strategy does after each optimizer step (``lightning/after_step.py``), through a real Trainer at one rank:
the gradients freed at once (the same numbers as Lightning with no strategy), Lightning's timing kept where a hook
could see the difference, and the communication figures logged every ``log_every_n_steps``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.world import one_rank_here

pytestmark = pytest.mark.timeout(300)

STEPS = 6


def _classes():
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
            self.losses: list[float] = []
            self.grads_after_step: list[bool] = []  # whether any parameter still had a gradient after the step

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).square().mean()
            self.losses.append(loss.item())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.grads_after_step.append(any(p.grad is not None for p in self.parameters()))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    class SeesGradsBeforeZeroGrad(Lit):
        def on_before_zero_grad(self, optimizer) -> None:  # the optimizer's (shard) parameters: the tree holds the
            self.seen = [p.grad is not None for g in optimizer.param_groups for p in g["params"]]  # gathered ones

    class ZeroesEveryOtherStep(Lit):
        """Keeps the gradients across two optimizer steps: whatever frees them early changes the numbers."""

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
            if batch_idx % 2 == 0:
                optimizer.zero_grad()

    class CallbackSeesGrads(L.Callback):
        def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
            pass

    return L, Lit, SeesGradsBeforeZeroGrad, ZeroesEveryOtherStep, CallbackSeesGrads


def _fit(module, strategy, callbacks=(), logger=False, log_every_n_steps=50):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(4 * STEPS, 5, generator=torch.Generator().manual_seed(1))),
                      batch_size=4)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=logger,
                        callbacks=list(callbacks), log_every_n_steps=log_every_n_steps, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    with one_rank_here():
        trainer.fit(module, data)
    return trainer


def _params(module) -> list[torch.Tensor]:
    return [v.detach().clone() for v in module.state_dict().values()]


def test_gradients_are_freed_after_each_step_with_lightnings_numbers():
    from lightning_shard import ShardStrategy

    _, Lit, *_ = _classes()
    plain, freed, kept = Lit(), Lit(), Lit()
    _fit(plain, "auto")
    trainer = _fit(freed, ShardStrategy())
    assert trainer.strategy.frees_grads_after_step
    _fit(kept, ShardStrategy(free_grads_after_step=False))
    assert freed.grads_after_step == [False] * STEPS  # nothing holds them between the step and the next forward
    assert kept.grads_after_step == plain.grads_after_step == [True] * STEPS
    assert freed.losses == kept.losses == plain.losses  # one rank, fp32: bit for bit
    for a, b in zip(_params(freed), _params(plain)):
        assert torch.equal(a, b)


def test_lightnings_timing_is_kept_where_a_hook_could_tell():
    from lightning_shard import ShardStrategy

    _, Lit, SeesGradsBeforeZeroGrad, ZeroesEveryOtherStep, CallbackSeesGrads = _classes()
    sees = SeesGradsBeforeZeroGrad()
    trainer = _fit(sees, ShardStrategy())
    assert sees.seen and all(sees.seen)  # the last step's gradients, as Lightning with no strategy shows them there
    assert not trainer.strategy.frees_grads_after_step
    assert not _fit(Lit(), ShardStrategy(), callbacks=[CallbackSeesGrads()]).strategy.frees_grads_after_step
    # a module that keeps gradients across steps trains as without sharding
    plain, sharded = ZeroesEveryOtherStep(), ZeroesEveryOtherStep()
    _fit(plain, "auto")
    trainer = _fit(sharded, ShardStrategy())
    assert sharded.losses == plain.losses
    for a, b in zip(_params(sharded), _params(plain)):
        assert torch.equal(a, b)
    assert not trainer.strategy.frees_grads_after_step


def test_an_invalid_option_is_named_at_construction():
    from lightning_shard import ShardStrategy

    with pytest.raises(ValueError, match=r"`free_grads_after_step` must be True or False, got 'yes'"):
        ShardStrategy(free_grads_after_step="yes")


def test_communication_figures_are_logged_every_log_every_n_steps(tmp_path):
    import csv
    import glob

    from lightning.pytorch.loggers import CSVLogger

    from lightning_shard import ShardStrategy

    _, Lit, *_ = _classes()
    for every, expected in ((1, STEPS), (3, STEPS // 3)):
        _fit(Lit(), ShardStrategy(), logger=CSVLogger(tmp_path / str(every)), log_every_n_steps=every)
        rows = list(csv.DictReader(open(glob.glob(str(tmp_path / str(every) / "*" / "*" / "metrics.csv"))[0])))
        logged = [r for r in rows if r.get("shard/collectives")]
        assert len(logged) == expected, (every, rows)
