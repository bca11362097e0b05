"""What peft does to parameters behind the strategy's back, against one process on the same global batch at 2-3 gloo
ranks (peft_pattern_scenarios.py)."""

from __future__ import annotations

import pytest

from tests import peft_pattern_scenarios as s
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("loss,reference_grad,mode,world", [
    ("dpo", False, "full", 2), ("dpo", True, "grad_op", 3), ("two_adapters", True, "full", 2)])
def test_passes_that_toggle_requires_grad_train_as_one_process(loss, reference_grad, mode, world):
    """(DPO's reference pass through disable_adapter() froze the adapters for its forward, and the reduction kept
    that: every adapter's update was exactly zero, 3.0e-2 off one process after 3 steps.)"""
    off = run_world(s.against_one_process, world, loss, reference_grad, mode, timeout=250)
    assert max(off) <= 1e-5, off


@pytest.mark.parametrize("on_meta", [False, True])
def test_a_tie_by_views_is_refused_at_setup_naming_it(on_meta):
    """(Each view was sharded apart: the first loss equal, then 6.7e-3 off DDP and the tie 0.032 apart.)"""
    for message in run_world(s.tied_by_views, 2, on_meta, timeout=200):
        assert "lm_head.lora_B.default.weight" in message and "ensure_weight_tying=False" in message, message


def test_dora_on_a_base_built_on_the_meta_device_gets_its_magnitudes_from_the_loaded_base(tmp_path):
    """(Refused at setup: "Cannot materialise ... lora_magnitude_vector", so no DoRA run could load its base by
    slices.) The magnitudes equal get_peft_model's on from_pretrained's base, and two steps follow DDP."""
    from tests.mixed_scenarios import write_base

    write_base(str(tmp_path))
    for report in run_world(s.dora_on_meta, 2, str(tmp_path), timeout=250):
        assert report["count"] == 4 and report["magnitudes"] == 0.0, report
        assert report["after two steps"] <= 1e-5, report
