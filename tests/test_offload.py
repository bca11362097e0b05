"""CPU offload (issue 31): the host-step path gives the numbers of the device step. On the CPU the offloaded and
the plain run step the same tensors with the same kernels, so they are compared bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests import offload_scenarios as scenarios
from tests.engine_scenarios import parity
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offloaded_training_with_clipping_and_accumulation_matches_ddp(offload):
    run_world(parity, 2, "gpt", ("full", "grad_op", "none"), 10, 2, 0.05, offload, timeout=500)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_a_lightning_fit_with_offload_equals_the_fit_without_bit_for_bit(optimizer):
    report = run_world(scenarios.same_as_without, 2, optimizer, timeout=500)[0]
    assert report["skipped"] == 1  # the non-finite step was skipped, as without offload
    for offload, kept in (("optimizer", True), ("params", False)):
        assert report[offload]["losses"] and report[offload]["weights"] == [], (offload, report[offload])
        assert report[offload]["offloaded"] and report[offload]["skipped"] == 1
        assert set(report[offload]["kept_on_device"]) == {kept}


@pytest.mark.parametrize("fused, write_between", [(True, False), (False, True)])
def test_writes_no_version_counter_sees_reach_the_gpu_copies(fused, write_between):
    # fused AdamW's step and `.data` writes leave the version counters alone: the copies on the device are made
    # again from the master at every step and after every optimizer step all the same
    report = run_world(scenarios.written_between_steps, 2, fused, write_between, timeout=300)[0]
    assert report == {"optimizer": (True, []), "params": (True, [])}


def test_adamw_with_no_implementation_chosen_steps_with_the_fused_cpu_kernel_when_offloaded():
    report = run_world(scenarios.fused_by_default, 2, timeout=300)[0]
    assert report["fused"] == []  # bit for bit the plain run with AdamW(fused=True)
    assert report["for-loop"] != []  # and not the for-loop torch picks on the CPU (an ulp apart at times)
    assert report["fused_option_after"] is None  # the user's options, what checkpoints save, are left alone


def test_checkpoints_move_between_offloaded_and_plain_runs_and_world_sizes(tmp_path):
    for offload in (None, "params"):
        for kind in ("sharded", "full"):
            run_world(scenarios.save, 2, offload, kind, str(tmp_path), timeout=300)
    cases = [(None, "params", "sharded"), ("params", None, "sharded"), ("params", "optimizer", "full"),
             (None, "optimizer", "full")]
    assert run_world(scenarios.resume, 2, cases, str(tmp_path), timeout=500)[0] == [[]] * len(cases)
    cases = [("params", "params", "sharded"), ("params", None, "full")]  # 2 ranks -> 3
    assert run_world(scenarios.resume, 3, cases, str(tmp_path), timeout=500)[0] == [[]] * len(cases)


def test_a_meta_device_model_materialises_into_host_shards():
    assert run_world(scenarios.meta_init, 2, timeout=300) == [[], []]


def test_bad_offload_values_are_named_at_construction():
    from lightning_shard import ShardStrategy

    with pytest.raises(ValueError, match=r"`offload` must be None .*'optimizer' .*'params'.*got 'cpu'"):
        ShardStrategy(offload="cpu")
    assert ShardStrategy(offload=False).offload is None


def _tiny(offload):
    from lightning_shard.engine.shard_module import shard_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, shard_module(model, units=["Linear"], offload=offload)


def test_offload_on_a_cpu_run_says_it_keeps_the_same_memory():
    with pytest.warns(UserWarning, match="offload='params' on a CPU run saves no memory"):
        _tiny("params")


def test_optimizers_that_step_on_the_gpu_only_are_refused(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, runtime = _tiny("optimizer")
    GpuOnlyAdam = type("Adam8bit", (torch.optim.AdamW,), {"__module__": "bitsandbytes.optim.adamw"})
    with runtime.shaped_parameters():
        optimizer = GpuOnlyAdam(model.parameters())
    with pytest.raises(ValueError, match="Adam8bit \\(from bitsandbytes\\) steps on the GPU only"):
        runtime.attach_optimizer(optimizer)
    import torch.optim.optimizer as torch_optimizer

    monkeypatch.setattr(torch_optimizer, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    with runtime.shaped_parameters():
        optimizer = torch.optim.AdamW(model.parameters(), fused=False)
    optimizer.param_groups[0]["fused"] = True  # as a torch whose CPU has no fused kernel would have it
    with pytest.raises(ValueError, match=r"AdamW\(fused=True\) has no CPU kernel"):
        runtime.attach_optimizer(optimizer)


def test_offloaded_optimizer_state_stays_on_the_host_at_setup(monkeypatch):
    # Lightning's setup moves every optimizer's state to the root device: torch's Adagrad builds its state when it is
    # built, so on a GPU its offloaded accumulators went to the device while the CPU steps the host shards (issue 49's
    # suspicion). On the CPU the move is a no-op, so the test watches for it.
    import lightning as L

    import lightning_shard.lightning.strategy as strategy_module
    from lightning_shard import ShardStrategy
    from tests.lightning_app import LitGPT, loader
    from tests.world import one_rank_here

    moved = []
    monkeypatch.setattr(strategy_module, "_optimizers_to_device", lambda optimizers, device: moved.append(device))

    class AdagradGPT(LitGPT):
        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=1e-2, initial_accumulator_value=0.1)

    for offload in ("optimizer", None):
        with one_rank_here():
            trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ShardStrategy(offload=offload), max_steps=2,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0)
            trainer.fit(AdagradGPT(), loader(1))
    assert len(moved) == 1, moved  # the run without offload only
