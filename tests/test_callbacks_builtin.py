"""Lightning's built-in callbacks and tuner under ShardStrategy at 2 gloo ranks, against Lightning's ddp in the same
world (``tests/callback_scenarios.py``; one world per test, several scenarios each)."""

from __future__ import annotations

import pytest

from tests import callback_scenarios as scenarios
from tests.world import run_world, scenarios_passed

pytestmark = pytest.mark.timeout(400)


def run(tmp_path, *names: str) -> dict:
    return scenarios_passed(run_world(scenarios.run_scenarios, 2, list(names), str(tmp_path), timeout=300))


def test_callbacks_and_tuner_as_ddp(tmp_path):
    """``Tuner.lr_find`` (its directory checkpoint restored and removed) and the ``LearningRateFinder`` callback;
    ``scale_batch_size``/``BatchSizeFinder`` refused as ddp's; ``GradientAccumulationScheduler`` under either
    ``reduce_during_accumulation``; a last accumulation window cut short by ``limit_train_batches``; ``EarlyStopping``
    at the train epoch's end and on validation, also inside an accumulation window, then fitted on; ``Timer``
    (``max_time``), its clocks apart on the ranks; the monitors' columns and learning rates; ``OnExceptionCheckpoint``
    after failures in four places, resumed by a new Trainer and by the failed one, and after failures before the
    model is sharded (the user's error raised, not an AssertionError of the checkpoint's state dict); ``fit`` twice,
    and a second, other model on one Trainer; fractional ``val_check_interval`` with step and top-k checkpoints;
    callback states resumed from sharded and full checkpoints; the model summary."""
    results = run(tmp_path, "lr_find", "lr_finder_callback", "scale_batch_size", "accumulation_scheduler",
                  "limit_batches_partial_window", "early_stopping", "validation_mid_window", "timer_stop", "monitors",
                  "exception_places", "exception_before_sharding", "fit_twice",
                  "fit_another_model", "val_interval_step_checkpoints", "callback_states_resumed", "model_summary")
    assert results["lr_find"]["suggestion"] is not None
    assert (results["accumulation_scheduler"]["True"], results["accumulation_scheduler"]["False"]) == (8, 8)
    assert results["val_interval_step_checkpoints"]["steps"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    assert [step for step, _ in results["validation_mid_window"]["True"]] == [1, 2, 4, 6, 8]


def test_callbacks_with_strategy_options(tmp_path):
    """The same against ddp on TinyGPT (tied embedding and head, blocks as units), with ``offload``, ``async_save``
    and ``hybrid`` sharding. Under ``reduce_during_accumulation=True`` the micro-batches' gradients are reduced one
    by one (a different rounding from ddp's one sum, grown by AdamW past 1e-5 on TinyGPT), so its accumulating runs
    here use ``False``."""
    run(tmp_path, "lr_find@offload='optimizer'", "lr_finder_callback@async_save=True",
        "accumulation_scheduler@model='gpt',reduce_during_accumulation=False",
        "validation_mid_window@model='gpt',reduce_during_accumulation=False",
        "exception_places@offload='optimizer'", "exception_before_sharding@state_dict_type='full'",
        "early_stopping@model='gpt'",
        "limit_batches_partial_window@sharding='hybrid',shard_size=1", "callback_states_resumed@model='gpt'",
        "fit_another_model@async_save=True", "model_summary@model='gpt'")
