"""The memory estimator against tensor-level measurement of real sharded steps (2 gloo ranks)."""

import pytest
import torch
from torch import nn

from lightning_shard.memory.estimate import estimate_memory
from tests import memory_scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 0.15  # the bound; measured agreement is ~2% (see README)


@pytest.mark.parametrize("sharding, options, batch_size", [
    ("full", {}, 16),
    ("full", {}, 2),  # parameters and optimizer state dominate
    ("grad_op", {}, 16),
    ("none", {}, 16),
    ("full", {"unit_size": 20000}, 16),
    ("full", {"unit_size": 60000, "prefetch": 2}, 16),
    ("full", {"offload": "optimizer", "param_dtype": torch.bfloat16}, 16),
    ("full", {"offload": "params"}, 2),
    ("full", {"frozen_blocks": 3}, 4),  # optimizer state for the trainable parameters alone
])
def test_estimate_within_tolerance_of_measurement(sharding, options, batch_size):
    for rank, report in enumerate(run_world(memory_scenarios.estimated_and_measured, 2, sharding, options, batch_size)):
        est = report["estimate"]  # offload on a CPU run: what lives on the device and on the host is one memory
        backward = est["activations"] + est["gathered"] + est["grads_in_flight"]
        peak = est["peak"] if not est["host"] else (est["params"] + est["buffers"] + est["host_resident"]
                                                    + max(backward, est["host_step"]))
        ratio = peak / report["measured"]
        assert abs(ratio - 1) <= TOLERANCE, (rank, ratio, report)


def test_activation_checkpointing_cuts_activation_memory_and_the_estimate_follows():
    plain = run_world(memory_scenarios.estimated_and_measured, 2, "full", {}, 16)[0]
    checkpointed = run_world(memory_scenarios.estimated_and_measured, 2, "full", {"activation_checkpointing": True}, 16)[0]
    assert checkpointed["measured"] < 0.6 * plain["measured"], (checkpointed, plain)
    assert abs(checkpointed["estimate"]["peak"] / checkpointed["measured"] - 1) <= TOLERANCE
    assert checkpointed["estimate"]["activations"] < 0.5 * plain["estimate"]["activations"]


@pytest.mark.parametrize("precision, accumulate, free_grads", [
    ("bf16-mixed", 1, False), ("bf16-mixed", 1, True), ("32-true", 1, True), ("bf16-mixed", 2, True)])
def test_estimate_of_a_lightning_step_within_ten_percent(precision, accumulate, free_grads):
    """Through the Trainer: its automatic optimization clears gradients between forward and backward, so unless the
    strategy freed them after the step the last step's gradient shards are alive beside the activations
    (accumulating, the micro-batches' sums are alive through every backward), and bf16-mixed runs under autocast. A
    model whose gradient shards are large beside its activations (12 blocks, 2 sequences a rank): leaving the held
    gradients out put the estimate 13% (bf16-mixed) to 22% (accumulating) low."""
    for rank, report in enumerate(run_world(memory_scenarios.through_lightning, 2, precision, accumulate, free_grads)):
        est = report["estimate"]
        assert report["freed"] == free_grads
        assert est["grads_in_forward"] == (est["grads"] if accumulate > 1 or not free_grads else 0) and est["grads"] > 0
        assert est["grads_in_backward"] == (est["grads"] if accumulate > 1 else 0)
        ratio = est["peak"] / report["measured"]
        assert abs(ratio - 1) <= 0.10, (rank, ratio, report)


def test_gradients_freed_after_the_step_lower_a_lightning_step_peak():
    """The strategy's default frees the gradient shards after the optimizer step: where the forward's activations make
    the peak (8 sequences a rank), it is lower by most of their size than with Lightning's own zero_grad after that
    forward (measured: 85%; what remains is the backward's gradients in flight)."""
    kept, freed = (run_world(memory_scenarios.through_lightning, 2, "bf16-mixed", 1, free, 8)[0]
                   for free in (False, True))
    assert kept["measured"] - freed["measured"] > 0.6 * kept["estimate"]["grads"], (kept, freed)


def test_batch_norms_are_units_of_their_own_under_mixed_precision_as_the_strategy_plans_them():
    """Under a param_dtype a batch norm is a unit of its own (sharded, computing in fp32), not part of the root unit
    (gathered all step): the estimate's parameters are the master shards alone, 1/2 of each unit per rank."""
    model = nn.Sequential(nn.Linear(8, 2000), nn.BatchNorm1d(2000), nn.Linear(2000, 8))
    shards = (8 * 2000 + 2000) // 2 + 2 * 2000 // 2 + (2000 * 8 + 8) // 2
    assert estimate_memory(model, 2, units=["Linear"], param_dtype=torch.bfloat16).params == shards * 4


def test_a_step_fake_tensors_cannot_run_says_what_to_do():
    """transformers 5's routed experts (grouped_mm) run on fake tensors in bf16 only: one clear error, not torch's."""
    pytest.importorskip("transformers")
    from tests.moe_folder_scenarios import config, model_class

    model = model_class("mixtral")(config("mixtral"))
    ids = torch.randint(0, 96, (2, 8))
    with pytest.raises(ValueError, match="could not run on fake tensors .*Estimate without activations"):
        estimate_memory(model, 2, step=lambda m, b: m(input_ids=b, labels=b, use_cache=False).loss, batch=ids)
