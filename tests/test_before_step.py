"""Before an optimizer step (issue 49): the ``nonfinite`` policy with gradient accumulation and under a gradient
scaler, a plain GradScaler on sharded gradients, clipping where one rank dropped a gradient."""

from __future__ import annotations

import pytest
import torch

from tests import before_step_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)


def test_an_infinite_micro_batch_skips_its_whole_step_like_one_process():
    """The policy ran at the end of every backward: an inf in micro-batch 0 of 2 cleared the gradients, micro-batch 1
    accumulated a partial one and the optimizer stepped with it (0.05 off one process). Now it runs before the step
    on the accumulated gradient: the whole step is skipped, whatever the accumulation (rtol 1e-5, atol 1e-6)."""
    cases = [("full", "reduce"), ("full", "no_sync"), ("grad_op", "reduce"), ("grad_op", "no_sync"),
             ("none", "reduce"), ("none", "no_replica_sync")]
    assert run_world(scenarios.skip_with_accumulation, 2, cases, timeout=300) == [dict.fromkeys(cases, 1)] * 2
    assert run_world(scenarios.skip_with_accumulation, 1, cases[:2], timeout=200) == [dict.fromkeys(cases[:2], 1)]


def test_a_raw_step_with_a_closure_is_checked_after_its_closure():
    assert run_world(scenarios.skip_in_a_closure, 2, timeout=120) == [{"skipped": 1}] * 2


@pytest.mark.parametrize("policy", [None, "skip"])
def test_a_gradient_scaler_backs_off_under_the_nonfinite_policy_like_one_process(policy):
    """fp16 with nonfinite="skip": the policy cleared the infinite gradients before the scaler's unscale_ saw them, so
    the scale never backed off (12 of 12 steps skipped, stuck at 65536). The scaler sees them first now."""
    for report in run_world(scenarios.scaler_backs_off, 2, policy, timeout=200):
        assert report["scale"] == report["reference_scale"] < 2.0**16 / 8, report
        assert report["skipped_by_policy"] == 0  # the scaler skipped them (the policy sees what it lets through)


@pytest.mark.parametrize("sharding,overflow_on", [("full", -1), ("full", 1), ("grad_op", 0), ("none", -1)])
def test_a_plain_grad_scaler_on_sharded_gradients_agrees_like_a_sharded_one(sharding, overflow_on):
    """torch.amp.GradScaler checks this rank's shard alone: with an inf on one rank's shard, that rank skipped the step
    while the other took it ([False, True]), and their scales parted. Its unscale_ now agrees across ranks: the same
    scales and weights as ShardedGradScaler (itself checked against one process above), on every rank."""
    for report in run_world(scenarios.plain_grad_scaler, 2, sharding, overflow_on, timeout=120):
        plain, sharded = report["GradScaler"], report["ShardedGradScaler"]
        assert plain["scales"] == sharded["scales"], report
        assert (plain["scales"][1] < plain["scales"][0]) == (overflow_on >= 0), plain["scales"]  # it skipped, on both
        assert all(torch.equal(plain["state"][k], v) for k, v in sharded["state"].items())


def test_lightnings_grad_scaler_becomes_a_sharded_one_with_its_settings():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_shard.lightning.precision import ShardPrecision, ShardedGradScaler

    given = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    scaler = ShardPrecision.from_lightning(MixedPrecision("16-mixed", "cpu", scaler=given)).scaler
    assert type(scaler) is ShardedGradScaler
    assert (scaler._init_scale, scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval) == (
        1024.0, 3.0, 0.25, 7)


@pytest.mark.parametrize("sharding", ["full", "grad_op"])
def test_clipping_where_one_rank_dropped_a_gradient_agrees(sharding):
    for report in run_world(scenarios.clipping_with_a_dropped_gradient, 2, sharding, timeout=120):
        assert "blocks.0.0.weight" in report["names"]  # a gradient on some rank: named on every rank
        assert report["total"] == pytest.approx(report["expected"], rel=1e-6)
        assert report["clipped_total"] == pytest.approx(report["expected"], rel=1e-6)
