"""fp32 training with the sharded engine matches DDP on the same global batch, 2 and 3 gloo ranks."""

import pytest

from tests.engine_scenarios import SCENARIOS, parity, parity_all
from tests.world import run_world

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_scenario_matches_ddp(world_size):
    # one world for all scenarios; a mismatch names its scenario and sharding ("[odd/grad_op] ...")
    reports = run_world(parity_all, world_size, timeout=700)
    for scenario in SCENARIOS:
        assert all(r[scenario]["full"]["last_loss"] < r[scenario]["full"]["first_loss"] for r in reports), scenario


@pytest.mark.parametrize("world_size", [2, 3])
def test_norm_clipping_and_accumulation_match_ddp(world_size):
    run_world(parity, world_size, "gpt", ("full", "grad_op", "none"), 20, 2, 0.05)
