"""Issue 30: torch's fused optimizer kernel for the sharded step where the user chose no implementation (on a GPU),
with DDP's numbers; the user's choice otherwise. Run on the CPU standing in for a GPU (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from lightning_shard.engine.optim.fused_default import fused_by_default
from tests import fused_scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


def test_fused_where_unchosen_with_ddps_numbers_and_the_users_options_kept():
    for report in run_world(fused_scenarios.against_ddp, 2):  # 1e-5 against DDP's for-loop, asserted inside
        for name in ("adamw", "adam_amsgrad"):  # one fused call per param group (2: weight decay or not) per step
            assert report[name]["fused_calls"] == {"adam": 24, "sgd": 0}, name
        assert report["sgd_nesterov"]["fused_calls"] == {"adam": 0, "sgd": 24}
        assert report["adamw_foreach"]["fused_calls"] == {"adam": 0, "sgd": 0}  # asked for foreach: foreach
        for run in report.values():  # only during the step: the groups (and checkpoints) keep the user's options
            assert set(run["groups_fused"]) == {None}


def test_step_counters_loaded_another_way_are_placed_for_the_fused_kernel():
    for report in run_world(fused_scenarios.counters_after_a_load, 2):
        assert report["loaded"] == ["torch.float64"] and report["stepped"] == ["torch.float32"]
        assert report["steps"] == [4.0]


def test_where_the_default_applies():
    cuda = torch.device("cuda")
    assert fused_by_default(torch.optim.AdamW, cuda, torch.float32) == ("cuda" in _fused_devices())
    assert not fused_by_default(torch.optim.AdamW, torch.device("cpu"), torch.float32)  # the CPU keeps DDP's bits
    assert not fused_by_default(torch.optim.AdamW, cuda, torch.bfloat16)  # fp32 masters only
    assert not fused_by_default(torch.optim.RMSprop, cuda, torch.float32)  # no fused kernel


def _fused_devices():
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def test_sgd_momentum_with_a_layer_unfrozen_later_steps_unfused_while_buffers_are_mixed():
    for report in run_world(fused_scenarios.sgd_momentum_unfrozen_later, 2):
        assert report["max_diff"] < 1e-6, report
        # fused while every stepped parameter has a buffer or none has; not at the unfreeze (a mix)
        assert report["fused_per_step"] == [1, 1, 0, 1, 1], report
