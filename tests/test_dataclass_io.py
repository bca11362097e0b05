"""Units whose calls take or return plain dataclasses (issue 49): FSDP2 walks into them, and so do the hooks."""

from __future__ import annotations

import pytest
import torch

from tests import dataclass_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world", [2, 3])
def test_units_taking_and_returning_dataclasses_train_like_one_process(world):
    """Under full sharding nothing saw the tensors inside a plain dataclass, so nothing gathered the unit before its
    backward (torch's 'setStorage: ... out of bounds for storage of size 0'). Nested, frozen, with a field outside
    __init__; with activation checkpointing; under bf16 the unit casts the tensors inside too (rtol 1e-5)."""
    cases = [("full", False, None), ("grad_op", False, None), ("full", True, None), ("full", False, torch.bfloat16)]
    assert run_world(scenarios.dataclass_io, world, cases, timeout=200) == [cases] * world
