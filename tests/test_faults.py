"""Faults end in a clear error within a bound, never a hang; a bad step never corrupts the model."""

import pytest

from tests.fault_scenarios import disagreeing_models, lost_rank, nonfinite
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)
BOUND = 8  # the process group timeout of these worlds, in seconds


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("where", ["forward", "backward", "save"])
def test_a_killed_rank_becomes_an_error_naming_the_collective(world_size, where):
    results = run_world(lost_rank, world_size, where, "kill", pg_timeout=BOUND, may_die=(world_size - 1,))
    for r in results[:-1]:
        assert r["error"] is not None, r
        assert "failed after" in r["error"] and ("unit" in r["error"] or "all-gather" in r["error"]), r["error"]
        assert r["seconds"] < BOUND + 5, r


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_stalled_rank_becomes_an_error_within_the_timeout(where):
    results = run_world(lost_rank, 2, where, "stall", pg_timeout=BOUND, may_die=(1,), timeout=120)
    r = results[0]
    assert r["error"] is not None and "unit" in r["error"], r
    assert r["seconds"] < BOUND + 10, r


def test_ranks_that_disagree_on_the_model_are_refused_at_setup():
    messages = run_world(disagreeing_models, 2)
    assert all(m and "Ranks disagree on the model" in m and "'0.weight'" in m for m in messages), messages


def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere():
    for r in run_world(nonfinite, 2, "skip"):
        assert r == {"error": None, "skipped": 1, "unchanged": True, "moved_after": True, "finite": True}, r


def test_nonfinite_gradient_can_stop_with_the_step_and_unit():
    for r in run_world(nonfinite, 2, "error"):
        assert r["error"] and "non-finite gradient at step 1, first in unit" in r["error"], r
