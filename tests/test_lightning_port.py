"""Lightning's own strategy tests (FSDPStrategy's, ModelParallelStrategy's, DDP's and the strategy-generic ones),
ported to ShardStrategy at 2 gloo ranks against Lightning's ddp in the same world: the scenarios are in
``tests/lightning_port_scenarios.py``, several per world; one group runs through Lightning's subprocess launcher."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests import lightning_port_scenarios as scenarios
from tests.world import run_world, scenarios_passed

pytestmark = pytest.mark.timeout(600)


def run(tmp_path, *names: str) -> dict:
    return scenarios_passed(run_world(scenarios.run_scenarios, 2, list(names), str(tmp_path), timeout=500))


def test_checkpoints_round_trip_and_resume_as_ddp(tmp_path):
    """fit, test, save, test/predict from the checkpoint under inference_mode, and fit on (``_run_multiple_stages``);
    ``lightning_module_state_dict`` keys and order; full checkpoints resumed under ddp and ddp's under ShardStrategy,
    bit for bit; sharded ones by path and by ``"last"`` (optimizer and scheduler states as an uninterrupted ddp run);
    one consolidated, then resumed under ddp; two optimizers in manual optimization resumed; a strategy that does
    not restore optimizers (``lightning_restore_optimizer``)."""
    results = run(tmp_path, "multiple_stages_full", "module_state_dict_keys", "save_full_resume_under_ddp",
                  "ddp_checkpoint_resumed_sharded", "sharded_checkpoint_resume", "consolidated_resumed_under_ddp",
                  "manual_two_optimizers_resume", "restore_optimizer_flag")
    keys = ["steps_seen", "layer.0.weight", "layer.0.bias", "layer.2.weight", "layer.2.bias"]
    assert results["module_state_dict_keys"]["sharded"] == results["module_state_dict_keys"]["full"] == keys
    assert results["sharded_checkpoint_resume"]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                             "manifest.json", "meta.pt"]


def test_what_the_module_does_to_its_checkpoints(tmp_path):
    """A LightningModule's ``state_dict`` that leaves its frozen part out (Lightning's "partial loading" recipe) is
    honoured by sharded checkpoints too (they saved every parameter); ``on_save_checkpoint`` renames keys and
    ``on_load_checkpoint`` renames them back and resets a value, under either format (a sharded checkpoint's
    ``checkpoint["state_dict"]`` had no keys: AttributeError); ``strict_loading`` as ddp's, both ways."""
    results = run(tmp_path, "state_dict_override_not_saving_frozen", "checkpoint_hooks_edit_state_dict",
                  "state_dict_override_renaming", "strict_loading")
    assert results["state_dict_override_not_saving_frozen"]["saved"] == [
        "layer.0.bias", "layer.0.weight", "layer.2.bias", "layer.2.weight"]
    # a state_dict that renames keys: kept by full checkpoints; refused at setup for sharded ones, saying where to
    # rename (they saved the shards under the module's names, silently)
    assert results["state_dict_override_renaming"]["saved"][0] == "backbone.bias"
    refused = results["state_dict_override_renaming"]["sharded"]
    assert refused.startswith("CheckpointError: BackboneNet.state_dict() gives keys the module does not have"
                              " ([old_layer.0.bias, old_layer.0.weight,"), refused
    strict = results["strict_loading"]
    for kind in ("sharded", "full"):
        assert strict[kind]["saved_extra=False, strict=False"] == strict[kind]["saved_extra=True, strict=False"] == \
            "loaded"
        assert "extra.weight" in strict[kind]["saved_extra=False, strict=None"]
        assert "extra.weight" in strict[kind]["saved_extra=True, strict=None"]
        assert "nowhere.weight" in strict[kind]["saved_extra=True, strict=None, planted"]
        assert strict[kind]["saved_extra=True, strict=False, planted"] == "loaded"


def test_building_the_model(tmp_path):
    """``configure_model`` (on the meta device) with a torchmetrics metric, ``init_module(empty_init=...)`` under 32-true
    and bf16-true, materialisation by ``reset_parameters`` (a module without one refused by name), a head built in
    ``setup``, activation checkpointing by the strategy, by torch's ``checkpoint_wrapper``, and both."""
    results = run(tmp_path, "configure_model_and_metrics", "module_init_context", "meta_device_materialization",
                  "setup_hook", "activation_checkpointing")
    materialized = results["meta_device_materialization"]
    assert materialized[False] == "materialized"
    assert materialized[True].startswith("ValueError: Cannot materialise ['extra.0.weight'] from the meta device")
    assert {k: v for k, v in results["activation_checkpointing"].items() if k != "seconds"} == {
        "strategy": "exact", "manual": "exact", "both": "exact"}


def test_loops_logging_and_collectives(tmp_path):
    """``validate``/``test`` after fit from the best checkpoint (weights unchanged), the strategy's collectives,
    ``sync_dist`` logging with every ``reduce_fx`` and ``all_gather(sync_grads=True)`` in the loss,
    ``num_sanity_val_steps`` with and without ``keep_gathered_in_eval``, and ``sync_batchnorm`` (GPUs only: said on
    the CPU by both strategies)."""
    results = run(tmp_path, "evaluate_after_fit", "strategy_collectives", "sync_dist_logging", "sanity_val_steps",
                  "sync_batchnorm")
    assert results["sanity_val_steps"][2] == 6 and results["sanity_val_steps"][-1] == 8  # 2 + 4, 4 + 4 batches


def test_through_lightnings_subprocess_launcher(tmp_path):
    """``Trainer(devices=2)`` from a script: Lightning's launcher starts rank 1 by re-running it."""
    proc = subprocess.run([sys.executable, scenarios.__file__, str(tmp_path), "multiple_stages_sharded"],
                          capture_output=True, text=True, timeout=500, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    assert "error" not in results["multiple_stages_sharded"], results["multiple_stages_sharded"]["error"]
    assert results["multiple_stages_sharded"]["steps"] == 8


def test_precision_plugins_other_than_lightnings_own_are_refused():
    """test_fsdp.py ``test_forbidden_precision_raises``: a plugin the strategy cannot honour is refused at once. A
    subclass of Lightning's ``Precision`` with its own hooks (or ``BitsandbytesPrecision``, on a GPU) was replaced by
    the strategy's plugin silently; Lightning's plain ones, and subclasses of ShardPrecision, are taken."""
    import lightning as L
    from lightning.pytorch.plugins import HalfPrecision, MixedPrecision, Precision

    from lightning_shard import ShardStrategy
    from lightning_shard.lightning.precision import ShardPrecision

    class DoubledLoss(Precision):
        def pre_backward(self, tensor, module):
            return super().pre_backward(tensor * 2, module)

    with pytest.raises(TypeError, match=r"so DoubledLoss's own behaviour would be lost. Choose the precision with"):
        L.Trainer(accelerator="cpu", devices=1, strategy=ShardStrategy(), plugins=[DoubledLoss()])
    with pytest.raises(ValueError, match=r"does not support `precision='16-true'`"):
        ShardStrategy(precision_plugin=HalfPrecision())
    with pytest.raises(ValueError, match=r"does not support `precision='16-true'`"):
        ShardStrategy().precision_plugin = HalfPrecision()

    class Mine(ShardPrecision):
        pass

    for plugin, precision in ((Mine("bf16-mixed"), "bf16-mixed"), (HalfPrecision("bf16-true"), "bf16-true"),
                              (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"), (Precision(), "32-true")):
        strategy = ShardStrategy(precision_plugin=plugin)
        assert isinstance(strategy.precision_plugin, ShardPrecision) and strategy.precision_plugin.precision == precision
    assert type(ShardStrategy(precision_plugin=Mine()).precision_plugin) is Mine
