"""fp32 training with the sharded engine matches DDP on the same global batch, 2 and 3 gloo ranks."""

import pytest

from tests.engine_scenarios import SCENARIOS, parity, parity_all, write_input_in_place
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


def test_a_unit_writing_its_input_in_place_stops_at_once_not_hangs():
    with pytest.raises(AssertionError) as failure:
        run_world(write_input_in_place, 2, timeout=120, pg_timeout=60)
    # rank 0 raises torch's refusal in its forward; rank 1 fails in its next collective as rank 0 exits
    assert "is being modified inplace" in str(failure.value), str(failure.value)[-3000:]
