"""Per-rank memory: parameters, gradients and optimizer state are 1/N of the model (plus padding)."""

import pytest

from tests.engine_scenarios import memory
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_sharding_holds_one_nth_per_rank(world_size):
    for r in run_world(memory, world_size, "full"):
        share = r["unsharded"] / world_size
        slack = r["padding"]  # at most world_size - 1 elements per unit
        assert share <= r["param"] <= share + slack, r
        assert share <= r["grad"] <= share + slack, r
        assert 2 * share <= r["state"] <= 2 * (share + slack), r  # AdamW: exp_avg and exp_avg_sq
        # the root unit plus the one computing, never more; nothing stays gathered after a step
        assert r["max_alive"] <= 2, r
        assert r["after_step"] == 0, r


def test_no_sharding_holds_the_whole_model():
    for r in run_world(memory, 2, "none"):
        assert r["param"] == r["unsharded"] + r["padding"], r
