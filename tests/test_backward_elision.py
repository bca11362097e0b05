"""Backward all-gathers are skipped exactly where autograd saved none of a unit's parameters."""

import pytest
import torch

from tests import engine_scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("scenario", ["untied_embedding", "checkpointed_blocks", "raw_input_stem"])
def test_same_results_as_ddp(scenario):
    run_world(engine_scenarios.parity, 2, scenario, ("full",), 10)


def test_embedding_unit_is_not_gathered_in_backward_and_nothing_else_changes():
    report = run_world(engine_scenarios.backward_gathers, 2, "untied_embedding")[0]
    on, off = report[True], report[False]
    assert on["losses"] == off["losses"]  # bit for bit
    for name in off["state"]:
        assert torch.equal(on["state"][name], off["state"][name]), name
    steps = len(on["losses"])
    assert on["per_unit"]["wte"]["all_gather"] == steps  # forward only
    assert on["per_unit"]["wte"]["skip_gather"] == steps and on["skipped_per_step"] == [1] * steps
    assert off["per_unit"]["wte"]["all_gather"] == 2 * steps and off["skipped_per_step"] == [0] * steps
    assert on["per_unit"]["wte"]["reduce"] == steps  # its gradient is still reduce-scattered
    for unit in ("blocks.0", "blocks.1"):  # a Linear saves its weight: gathered again in backward
        assert on["per_unit"][unit]["all_gather"] == 2 * steps and on["per_unit"][unit].get("skip_gather", 0) == 0


def test_modules_that_save_weights_for_raw_inputs_are_still_gathered():
    report = run_world(engine_scenarios.backward_gathers, 2, "raw_input_stem")[0]
    on = report[True]
    assert on["skipped_per_step"] == [0] * len(on["losses"])
    assert on["losses"] == report[False]["losses"]


def test_recomputed_units_gather_again():
    report = run_world(engine_scenarios.backward_gathers, 2, "checkpointed_blocks")[0]
    on, off = report[True], report[False]
    assert on["losses"] == off["losses"]
    # a checkpointed block saves nothing in forward (skipped), then its recompute gathers it again
    assert on["per_unit"]["blocks.0"]["all_gather"] == 2 * len(on["losses"])


@pytest.mark.parametrize("world", [2, 3])
def test_each_unit_is_gathered_as_often_as_its_backward_needs_every_step(world):
    """The token embedding once a step (forward only), each block twice but the last (kept from forward to its
    backward), the root once; fp32 and bf16, prefetch 1 and 2, a plain forward or the strategy's run_step."""
    cases = [{}, {"param_dtype": torch.bfloat16}, {"prefetch": 2}, {"run_step": True, "param_dtype": torch.bfloat16}]
    expected = {"<root>": 1, "wte": 1, "blocks.0": 2, "blocks.1": 2, "blocks.2": 1}
    for case, counts in zip(cases, run_world(engine_scenarios.gathers_per_step, world, cases)[0]):
        assert counts[0] == {**expected, "blocks.2": 2}, (case, counts)  # no order known yet: gathered in backward
        assert counts[1:] == [expected] * (len(counts) - 1), (case, counts)
