"""fp32 training with the sharded engine matches DDP on the same global batch, 2 and 3 gloo ranks."""

import pytest

from tests.engine_scenarios import SCENARIOS, parity
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_matches_ddp(scenario, world_size):
    reports = run_world(parity, world_size, scenario)
    assert all(r["full"]["last_loss"] < r["full"]["first_loss"] for r in reports), reports


@pytest.mark.parametrize("world_size", [2, 3])
def test_norm_clipping_and_accumulation_match_ddp(world_size):
    run_world(parity, world_size, "gpt", ("full", "grad_op", "none"), 20, 2, 0.05)
