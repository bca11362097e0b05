"""Mixed precision: fp32 masters, bf16 gathers and compute, fp32 reduction; a scaler that agrees."""

import pytest
import torch

from tests import precision_scenarios as scenarios
from tests.precision_scenarios import bf16_mixed_dtypes, scaler_overflow_on_one_rank
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


def test_bf16_mixed_keeps_fp32_masters_and_halves_gather_bytes():
    report = run_world(bf16_mixed_dtypes, 2)[0]
    fp32, bf16 = report["fp32"], report["bf16"]
    assert bf16["gathered"] == bf16["in_backward"] == bf16["unsharded_grad"] == torch.bfloat16
    assert bf16["shard_grad"] == torch.float32  # reduced in fp32, kept in fp32
    assert bf16["master"] == bf16["optimizer_state"] == {torch.float32}
    assert fp32["gathered"] == fp32["unsharded_grad"] == torch.float32
    # the all-gathers move half the bytes; the reduce-scatters stay fp32
    assert bf16["stats"]["all_gather_bytes"] * 2 == fp32["stats"]["all_gather_bytes"]
    assert bf16["stats"]["reduce_scatter_bytes"] == fp32["stats"]["reduce_scatter_bytes"]
    assert bf16["stats"]["reduce_scatter_bytes"] == 4 * sum(bf16["padded"].values())
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.02)


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_ranks_overflow_skips_the_step_everywhere(world_size):
    results = run_world(scaler_overflow_on_one_rank, world_size)
    assert all(r["unchanged"] for r in results), results
    assert {r["scale"] for r in results} == {2.0**7}  # every rank backed off the same way


def test_bf16_params_without_autocast_cast_the_inputs():
    assert run_world(scenarios.bf16_params_without_autocast, 2, timeout=200) == [True, True]
