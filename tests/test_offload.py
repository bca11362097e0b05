"""CPU offload (issue 31): the host-step path gives the numbers of the device step, exactly on the CPU."""

from __future__ import annotations

import pytest

from tests.engine_scenarios import parity
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offloaded_training_with_clipping_and_accumulation_matches_ddp(offload):
    run_world(parity, 2, "gpt", ("full", "grad_op", "none"), 10, 2, 0.05, offload, timeout=500)
