"""ShardedEMA and ShardedWeightAveraging against Lightning's EMAWeightAveraging and WeightAveraging under DDP (2 CPU
processes, gloo): the same losses (training on the weights trained), validation losses (on the average), final
weights (the average) and checkpoints, in both checkpoint formats, resumed from the checkpoint saved as a fit ended."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.world import one_rank_here

APP = os.path.join(os.path.dirname(__file__), "ema_app.py")
pytestmark = pytest.mark.timeout(600)
TIGHT = {"rtol": 1e-6, "atol": 1e-7}


def run_app(tmp_path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, APP, "--out", str(tmp_path), *args], capture_output=True, text=True,
                          timeout=500, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(tmp_path / "results.pt", weights_only=True)


def open_checkpoint(path) -> dict:
    from lightning_shard import consolidate

    return consolidate(path) if os.path.isdir(path) else torch.load(path, weights_only=True)


def assert_states_close(got: dict, want: dict, what: str, **tolerance) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **(tolerance or TIGHT), msg=lambda m: f"{what} {key}: {m}")


def assert_matches_lightning_ema(results: dict, name: str, **tolerance) -> None:
    ddp, run = results["ddp"], results[name]
    assert len(run["losses"]) == len(ddp["losses"]) == 24
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ddp["losses"]), **(tolerance or TIGHT))
    # a sanity check, then one validation per epoch, each on the average
    assert len(run["val_losses"]) == len(ddp["val_losses"]) == 4
    torch.testing.assert_close(torch.tensor(run["val_losses"]), torch.tensor(ddp["val_losses"]), **(tolerance or TIGHT))
    assert_states_close(run["state"], ddp["state"], f"{name} final weights (the average)", **tolerance)


def assert_checkpoints_match(results: dict, name: str, callback: str = "ShardedEMA", averaged: int = 8,
                             updated_at: int = 15) -> None:
    """An epoch's checkpoint inside fit: the average as state_dict, the weights trained as current_model_state, as
    Lightning's; the last one (saved as fit ended) has the average as state_dict too. ``averaged``: the updates by the
    end of epoch 1 (of 16 steps), the last of them after step ``updated_at``."""
    ours, theirs = open_checkpoint(os.path.join(os.path.dirname(results[name]["checkpoint"]), "epoch=1.ckpt")), \
        torch.load(os.path.join(os.path.dirname(results["ddp"]["checkpoint"]), "epoch=1.ckpt"), weights_only=True)
    for key in ("state_dict", "current_model_state"):
        assert_states_close(ours[key], theirs[key], f"{name} epoch=1.ckpt {key}")
    assert any(not torch.equal(ours["state_dict"][k], v) for k, v in ours["current_model_state"].items())
    assert int(ours["averaging_state"]["n_averaged"]) == int(theirs["averaging_state"]["n_averaged"]) == averaged
    assert ours["callbacks"][callback] == {"latest_update_step": updated_at}
    assert_states_close(open_checkpoint(results[name]["checkpoint"])["state_dict"],
                        torch.load(results["ddp"]["checkpoint"], weights_only=True)["state_dict"], f"{name} last.ckpt")


def assert_resumes(results: dict, name: str) -> None:
    """Resumed from the checkpoint the first fit saved as it ended (it holds the weights trained, where Lightning's
    callback saves the average twice): the same run as without the stop."""
    run, resumed = results[name], results[f"{name}_resumed"]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(run["losses"]), rtol=0, atol=0)
    # [first fit's sanity check and epoch 0] + [the resumed fit's sanity check, epochs 1 and 2]
    val = resumed["val_losses"][:2] + resumed["val_losses"][3:]
    torch.testing.assert_close(torch.tensor(val), torch.tensor(run["val_losses"]), rtol=0, atol=0)
    assert_states_close(resumed["state"], run["state"], f"{name} resumed", rtol=0, atol=0)


def test_sharded_ema_matches_lightning_ema_sharded_checkpoints_and_resume(tmp_path):
    results = run_app(tmp_path, "--sharding", "full", "none", "--resume")
    for name in ("full", "none"):
        assert_matches_lightning_ema(results, name)
        assert_checkpoints_match(results, name)
        assert_resumes(results, name)


def test_sharded_ema_full_checkpoints_units_held_in_validation_and_resume(tmp_path):
    # keep_gathered_in_eval makes the ranks' buffers rank 0's as validation starts: the average's, swapped in before
    results = run_app(tmp_path, "--sharding", "grad_op", "--state-dict-type", "full", "--keep-gathered-in-eval",
                      "--resume")
    assert_matches_lightning_ema(results, "grad_op")
    assert_checkpoints_match(results, "grad_op")
    assert_resumes(results, "grad_op")


def test_sharded_ema_offloaded_without_buffers_averaged(tmp_path):
    # offloaded, AdamW steps fused on the host: its roundings, not foreach's (engine/storage/offload.py); the average lives
    # there too. use_buffers=False: the buffers follow the model's
    results = run_app(tmp_path, "--sharding", "full", "--offload", "optimizer", "--no-buffers")
    assert_matches_lightning_ema(results, "full", rtol=1e-5, atol=2e-6)


def test_sharded_weight_averaging_matches_lightnings_equal_average_sharded_checkpoints_and_resume(tmp_path):
    """SWA: the equal average of the weights after every step (torch's per-tensor expression on the CPU)."""
    results = run_app(tmp_path, "--average", "swa", "--sharding", "full", "--resume")
    assert_matches_lightning_ema(results, "full")
    assert_checkpoints_match(results, "full", "ShardedWeightAveraging", averaged=16, updated_at=16)
    assert_resumes(results, "full")


def test_sharded_weight_averaging_with_a_multi_avg_fn_matches_lightnings(tmp_path):
    """A multi_avg_fn (torch's EMA by _foreach_lerp_ over each group of one device and dtype), the buffers followed."""
    results = run_app(tmp_path, "--average", "multi", "--sharding", "grad_op", "--state-dict-type", "full",
                      "--no-buffers")
    assert_matches_lightning_ema(results, "grad_op")
    assert_checkpoints_match(results, "grad_op", "ShardedWeightAveraging", averaged=16, updated_at=16)


# -- in one process -------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    ({"decay": 1.5}, r"`decay` must be a number in \[0, 1\]; got 1.5"),
    ({"decay": "0.9"}, r"`decay` must be a number"),
    ({"update_every_n_steps": -1}, r"`update_every_n_steps` must be an integer >= 0; got -1"),
    ({"update_starting_at_step": 2.5}, r"`update_starting_at_step` must be an integer >= 0 or None; got 2.5"),
    ({"device": "nowhere"}, r"nowhere"),
    ({"use_buffers": "no"}, r"`use_buffers` must be True or False; got 'no'"),
])
def test_bad_options_are_refused_at_construction(options, match):
    from lightning_shard import ShardedEMA

    with pytest.raises((ValueError, RuntimeError), match=match):
        ShardedEMA(**options)


@pytest.mark.parametrize("options, match", [
    ({"avg_fn": "ema"}, r"`avg_fn` must be a function or None; got 'ema'"),
    ({"multi_avg_fn": 0.9}, r"`multi_avg_fn` must be a function or None; got 0.9"),
    ({"use_buffers": 1}, r"`use_buffers` must be True or False; got 1"),
])
def test_bad_weight_averaging_options_are_refused_at_construction(options, match):
    from lightning_shard import ShardedWeightAveraging

    with pytest.raises(ValueError, match=rf"ShardedWeightAveraging: {match}"):
        ShardedWeightAveraging(**options)


def _lit():
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(5, 8), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Lit()


def _fit(strategy, callback, precision="32-true", checkpoints=None, resume=None):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    lit = _lit()
    data = DataLoader(TensorDataset(torch.randn(12, 5, generator=torch.Generator().manual_seed(1))), batch_size=4)
    # (no sampler put in: ShardStrategy is a parallel strategy, whose training sampler Lightning shuffles)
    saving = [L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, save_last=True)] if checkpoints else []
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                        callbacks=[callback, *saving], use_distributed_sampler=False, enable_checkpointing=bool(saving),
                        precision=precision, enable_progress_bar=False,
                        enable_model_summary=False)
    with one_rank_here():
        trainer.fit(lit, data, ckpt_path=resume)
    return lit, trainer


@pytest.mark.parametrize("callback, ours", [("EMAWeightAveraging", "ShardedEMA"),
                                            ("StochasticWeightAveraging", "ShardedWeightAveraging")])
def test_lightnings_averaging_callbacks_are_refused_at_setup_naming_them_and_ours(callback, ours):
    """They copy the whole module and average its parameters into the copy: under sharding a shape error at the first
    update (and the whole model copied on every rank first)."""
    from lightning.pytorch import callbacks

    from lightning_shard import ShardStrategy

    averaging = getattr(callbacks, callback)(**({"swa_lrs": 0.01} if callback.startswith("Stochastic") else {}))
    with pytest.raises(ValueError, match=rf"\['{callback}'\] keep a copy of the whole model.*lightning_shard.{ours} for"
                                         rf"[^.]*{callback}"):
        _fit(ShardStrategy(), averaging)


def test_under_another_strategy_it_says_which_callback_to_use():
    from lightning_shard import ShardedEMA, ShardedWeightAveraging

    with pytest.raises(TypeError, match="under SingleDeviceStrategy use Lightning's EMAWeightAveraging"):
        _fit("auto", ShardedEMA())
    with pytest.raises(TypeError, match="under SingleDeviceStrategy use Lightning's WeightAveraging"):
        _fit("auto", ShardedWeightAveraging())


def test_after_fit_the_model_holds_the_average_and_the_average_is_freed():
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_shard import ShardedEMA, ShardStrategy

    ema = ShardedEMA(decay=0.5)
    ours, trainer = _fit(ShardStrategy(), ema)
    # the estimate at setup counts it: one fp32 copy of the shards (57 parameters at one rank), no buffers
    assert trainer.strategy.memory_estimate.average == 57 * 4
    theirs, _ = _fit("auto", EMAWeightAveraging(decay=0.5))
    assert ema.average is None
    for (name, got), want in zip(ours.named_parameters(), theirs.parameters()):  # one rank: each shard is whole
        assert torch.equal(got, want.reshape(-1)), name


def test_an_avg_fn_per_tensor_gives_lightnings_average():
    """``avg_fn`` alone is called per tensor (here per flat shard) with the count of updates before, as a tensor."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging

    from lightning_shard import ShardedWeightAveraging, ShardStrategy

    def avg_fn(average, current, n_averaged):
        return average + (current - average) * (0.3 + 0.1 * n_averaged)

    ours, _ = _fit(ShardStrategy(), ShardedWeightAveraging(avg_fn=avg_fn))
    theirs, _ = _fit("auto", WeightAveraging(avg_fn=avg_fn))
    trained, _ = _fit("auto", EMAWeightAveraging(decay=0.0))  # the weights trained, for contrast
    for (name, got), want, other in zip(ours.named_parameters(), theirs.parameters(), trained.parameters()):
        assert torch.equal(got, want.reshape(-1)), name
        assert not torch.equal(want, other), name


def test_a_fit_resumed_at_its_end_leaves_the_average_in_the_model(tmp_path):
    """Resumed from the checkpoint saved as a fit ended, with nothing left to train (a re-queued finished job): no
    training ends, the fit does, and the model holds the average as after the first fit."""
    from lightning_shard import ShardedEMA, ShardStrategy

    first, _ = _fit(ShardStrategy(), ShardedEMA(decay=0.5), checkpoints=tmp_path)
    again, _ = _fit(ShardStrategy(), ShardedEMA(decay=0.5), checkpoints=tmp_path / "again",
                    resume=tmp_path / "last.ckpt")
    trained, _ = _fit(ShardStrategy(), ShardedEMA(decay=0.0))  # the weights trained, for contrast
    for (name, got), want, other in zip(again.named_parameters(), first.parameters(), trained.parameters()):
        assert torch.equal(got, want), name
        assert not torch.equal(got, other), name


def test_low_precision_master_weights_are_refused_naming_the_precision():
    from lightning_shard import ShardedEMA, ShardStrategy

    with pytest.raises(ValueError, match=r"master weights are torch.bfloat16 \(precision='bf16-true'"):
        _fit(ShardStrategy(), ShardedEMA(), precision="bf16-true")


def test_after_fit_a_checkpoint_evaluated_on_the_same_trainer_gives_its_average(tmp_path):
    """``trainer.validate/test/predict(ckpt_path=...)`` after fit evaluate the checkpoint's ``state_dict``, its average,
    as a fresh Trainer does (validate here) (Lightning's callback keeps its average after fit and loads the checkpoint's weights
    trained into the module there: a difference on purpose, README)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import ShardedEMA, ShardStrategy

    lit, trainer = _fit(ShardStrategy(state_dict_type="full"), ShardedEMA(decay=0.5), checkpoints=tmp_path)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    with torch.no_grad():
        for param in lit.parameters():
            param.add_(1.0)  # anything but the checkpoint's
    data = DataLoader(TensorDataset(torch.randn(4, 5)), batch_size=4)
    lit.validation_step = lambda batch, batch_idx: None
    with one_rank_here():
        trainer.validate(lit, data, ckpt_path=tmp_path / "last.ckpt")
    assert any(not torch.equal(saved["state_dict"][k], v) for k, v in saved["current_model_state"].items())
    for name, param in lit.named_parameters():  # one rank: each shard is whole
        assert torch.equal(param, saved["state_dict"][name].reshape(-1)), name
