"""Per-rank memory: parameters, gradients and optimizer state are 1/N of the model (plus padding)."""

import pytest

from tests.engine_scenarios import memory
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size, prefetch", [(2, 0), (2, 2), (3, 1)])
def test_full_sharding_holds_one_nth_per_rank(world_size, prefetch):
    for r in run_world(memory, world_size, "full", prefetch):
        share = r["unsharded"] / world_size
        slack = r["padding"]  # at most world_size - 1 elements per unit
        assert share <= r["param"] <= share + slack, r
        assert share <= r["grad"] <= share + slack, r
        assert 2 * share <= r["state"] <= 2 * (share + slack), r  # AdamW: exp_avg and exp_avg_sq
        # besides the root unit: the unit computing plus `prefetch` gathered ahead, never more
        assert r["max_alive"] == prefetch + 1, r
        # nothing stays gathered after a step
        assert r["after_step"] == 0, r


def test_no_sharding_holds_the_whole_model():
    for r in run_world(memory, 2, "none"):
        assert r["param"] == r["unsharded"] + r["padding"], r
