"""Offload's optimizer step overlapped with backward (engine/optim/host_step.py): each unit stepped by the CPU as its
gradient lands gives the numbers of the step after the backward, bit for bit, with clipping that asks for it on some
steps only (the speculative steps undone and redone), accumulation, a skipped non-finite step and a resume."""

from __future__ import annotations

import pytest

from tests import host_step_deferred_scenarios as deferred
from tests import host_step_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(900)


def _check(report: dict) -> None:
    assert report["losses"] == [] and report["weights"] == {"serial": [], "plain": [], "params": []}, report
    assert report["serial_overlapped"] == 0  # offload_overlap=False: never armed
    assert report["overlapped"] > 0 and report["params_overlapped"] > 0, report
    assert report["restage"] is False  # no hook of the module's runs between steps


@pytest.mark.parametrize("world", [2, 3])
def test_the_overlapped_host_step_equals_the_serial_one_bit_for_bit(world, tmp_path):
    cases = [
        # clipping asks on some steps, not others; accumulation; a non-finite last micro-batch (skipped)
        {"optimizer": "adamw", "clip": 3.0, "accumulate": 2, "nonfinite_at": (3,)},
        # resumed from a checkpoint of the first epoch; SGD with momentum (torch's for-loop on the CPU)
        {"optimizer": "sgd", "clip": 2.0, "accumulate": 1, "resume": True},
    ][: 2 if world == 2 else 1]
    reports = run_world(scenarios.overlapped_as_serial, world, cases, str(tmp_path), timeout=800)[0]
    for report in reports:
        _check(report)
    first = reports[0]
    assert 0 < first["clipped"] < first["overlapped"], first  # clipping changed some steps, not all
    assert first["skipped"] == 1 and first["redone"] > 0 and first["speculative"] > first["redone"], first


@pytest.mark.parametrize("world", [2, 3])
def test_the_next_forward_runs_behind_the_host_step_with_the_same_numbers(world, tmp_path):
    # a host slower than its device: optimizer.step() returns with most units still to step, and the next forward
    # waits for each unit's step as it gathers it; so do a norm of the parameters read in training_step before the
    # forward, clipping's redo, a skipped step and the checkpoints (a weight constraint: the next test). The second
    # has nothing to decide at the end of backward (no clipping, no non-finite check), so each unit's step is queued
    # as its gradient lands: the end of backward waited for all of them (its wait for the landings waited while the
    # worker was busy, and it was busy stepping), and nothing was left to run behind
    cases = [{"optimizer": "slow adamw", "clip": 3.0, "accumulate": 2, "nonfinite_at": (3,), "in_step": ("norm",)},
             {"optimizer": "slow adamw", "clip": None, "accumulate": 1, "in_step": ("norm",), "resume": True,
              "nonfinite": None},
             ][: 2 if world == 2 else 1]
    reports = run_world(scenarios.overlapped_as_serial, world, cases, str(tmp_path), timeout=800)[0]
    for report in reports:
        _check(report)
        assert report["deferred"] > 0, report  # (units stepped after their optimizer.step() returned)
    assert reports[0]["clipped"] > 0 and reports[0]["skipped"] == 1, reports[0]


def test_what_the_user_does_before_the_backward_overlaps_as_it_steps_serially():
    # the overlapped step was armed as the training step began: a learning rate set there (a warmup) was not the one
    # the units were stepped with, and a backward there (WGAN-GP's gradient penalty) was taken for the loss's, which
    # stepped every unit with the accumulated gradients; both stopped the fit with an error about a failed backward
    cases = {
        "lr set in training_step": {"optimizer": "adamw", "clip": 3.0, "accumulate": 2, "in_step": ("lr",)},
        "gradient penalty": {"optimizer": "adamw", "clip": 3.0, "accumulate": 1, "module": scenarios.Critic},
        # Trainer.gradient_clip_val changed between epochs: read as each step is armed (it was read at setup: clipping
        # turned off went on clipping, silently; turned on stopped the fit)
        "clipping turned off": {"optimizer": "adamw", "clip": 0.05, "accumulate": 1, "clip_by_epoch": (0.05, None)},
        "clipping turned on": {"optimizer": "adamw", "clip": None, "accumulate": 1, "clip_by_epoch": (None, 0.05)},
        "clipping at -1 (none, to Lightning)": {"optimizer": "adamw", "clip": -1.0, "accumulate": 1},
        # a write through .data in training_step, before the forward: the step's first gathers used the copies the
        # worker made before it, silently (no version counter sees it, and no hook of the module's is overridden)
        "weights clamped in training_step": {"optimizer": "adamw", "clip": 3.0, "accumulate": 1, "in_step": ("clamp",)},
        # the same where the host is behind: the write through .data waits for the unit's step still to come
        "weights clamped, the host behind": {"optimizer": "slow adamw", "clip": None, "accumulate": 1,
                                             "in_step": ("clamp",)},
        # a step pre-hook runs after the units were stepped: such an optimizer is stepped after the backward (it raised
        # that the learning rate changed)
        "warmup in a step pre-hook": {"optimizer": "adamw with a warmup hook", "clip": 3.0, "accumulate": 1},
        # the user's optimizer raising in the worker: its error, not one about steps that cannot be undone
        "optimizer raising": {"optimizer": "failing", "clip": None, "accumulate": 1, "nonfinite": None},
    }
    report = run_world(scenarios.overlapped_like_serial, 2, cases, timeout=600)[0]
    assert report == {**{name: "same" for name in cases}, "warmup in a step pre-hook": "not overlapped",
                      "optimizer raising": ("raised", "ValueError: the user's optimizer failed")}, report


def test_the_next_forward_begins_before_the_host_has_stepped_every_unit():
    # finish_in_forward did not let the next forward run behind the worker under Lightning: the strategy's zero_grad
    # right after the step (free_grads_after_step), or else the step's start (it reads every unit's requires_grad),
    # and optimizer.step()'s own check of the gradients waited for every unit's step (the guard on the shard
    # parameters waits for any use of them): the steps were deferred, and waited for all the same
    cases = {"gradients freed after the step": {"clip": None, "accumulate": 1},
             "gradients kept, clipping": {"clip": 3.0, "accumulate": 1, "free_grads_after_step": False}}
    report = run_world(deferred.forward_behind_the_host, 2, cases, timeout=600)[0]
    assert report == {name: {"gated": 2, "held": 0, "same": True} for name in cases}, report


def test_a_collective_inside_the_forward_meets_the_same_gathers_on_every_rank_behind_the_host():
    # a prefetch skipped the unit whose step was still to come on this rank (its own gather waited for it): where the
    # host was behind on one rank only, the ranks all-gathered that unit before and after a collective of the forward
    # in between (SyncBatchNorm's), each in its own order: a collective mismatch (gloo: "Received data size doesn't
    # match"; NCCL: a hang, or another collective's bytes where they have the same size)
    cases = {"an all-reduce in each block's forward": {"optimizer": "skewed adamw", "clip": None, "accumulate": 1,
                                                      "module": deferred.SyncedGPT}}
    report = run_world(scenarios.overlapped_like_serial, 2, cases, timeout=300, pg_timeout=30)[0]
    assert report == {name: "same" for name in cases}, report


def test_what_runs_between_steps_waits_for_the_host_steps_still_to_come():
    # optimizer.step() returns with units still to step (finish_in_forward), and what Lightning runs before the next
    # forward went on beside the worker: a tensor learning rate written in place by the per-step LR scheduler (fill_)
    # was the one the units still to step used; ShardedEMA's update read the master shards before their step (not
    # through the shard parameters)
    cases = {
        "a tensor lr decayed in place each step": {"optimizer": "slow adamw, a tensor lr decayed each step",
                                                   "clip": None, "accumulate": 1},
        "ShardedEMA": {"optimizer": "slow adamw", "clip": None, "accumulate": 1, "ema": True},
        # a step post-hook runs as optimizer.step() returns: it read the optimizer's state before the units' steps
        "a step post-hook reading the optimizer's state": {
            "optimizer": "slow adamw, a step post-hook reading its state", "clip": None, "accumulate": 1},
    }
    report = run_world(scenarios.overlapped_like_serial, 2, cases, timeout=600)[0]
    assert report == {name: "same" for name in cases}, report


def test_the_host_worker_issues_no_collective():
    # SlowAdamW's step calls AdamW's, which torch wraps with the optimizer hooks once any AdamW was built in the
    # process: the engine's global step pre-hook ran inside the worker's step of each unit, and with nonfinite set it
    # agreed on the gradients' finiteness (an all-reduce) from the worker thread, in whatever order it met the main
    # thread's collectives of the backward (and, behind optimizer.step(), of the next forward) on each rank: a
    # collective mismatch (gloo aborts the rank; NCCL hangs)
    case = {"optimizer": "slow adamw", "clip": None, "accumulate": 1, "nonfinite": "skip"}
    report = run_world(deferred.collectives_of_the_worker, 2, case, timeout=600)[0]
    assert report == {"off the main thread": [], "overlapped": True, "same": True}, report


def test_an_optimizer_keeping_state_outside_its_parameters_is_refused_by_the_overlapped_step():
    # stepped unit by unit, a step count kept in the param group (timm's Adan) or in optimizer.state["k"] (MADGRAD's)
    # was counted once per unit, or not at all: silently other numbers than the serial step's
    # an optimizer writing the gradients in place stopped the fit with "the gradient of ... changed between the backward
    # and the optimizer step", blaming the user
    cases = {"in the param group": {"optimizer": "counting in group", "clip": 3.0, "accumulate": 1},
             "in optimizer.state": {"optimizer": "counting in state", "clip": None, "accumulate": 1},
             "in the gradients": {"optimizer": "counting in gradients", "clip": 3.0, "accumulate": 1}}
    report = run_world(scenarios.overlapped_like_serial, 2, cases, timeout=600)[0]
    for name, where in (("in the param group", "param group 0's 'step'"),
                        ("in optimizer.state", "optimizer.state['k']"), ("in the gradients", "the gradient of 'model.")):
        overlapped, serial = report[name]
        assert serial is None and "CountingSGD's step wrote outside its parameters' state" in overlapped, report
        assert where in overlapped and "offload_overlap=False" in overlapped, overlapped


def test_the_worker_steps_while_a_gradient_is_still_on_its_way():
    # a landing whose copy has not arrived must not hold back a step there is to do (it did: every step waited for
    # the whole backward to land, and nothing overlapped); an arrived one goes first
    import threading

    import torch

    from lightning_shard.engine.optim.host_worker import HostWorker

    # the worker chooses once all four are queued (step 1 waits for that), and the copy arrives only once step 3 has
    # run (a hang if steps waited for it: a timer ends that), so the order does not depend on how soon the worker
    # thread is scheduled (a 0.5 s timer's did, on a loaded machine)
    worker, done, queued, arrived = HostWorker(torch.device("cpu")), [], threading.Event(), threading.Event()
    worker.submit(lambda: (queued.wait(), done.append("step 1")))
    worker.submit(lambda: (arrived.wait(), done.append("land 2")), ready=arrived.is_set)
    worker.submit(lambda: (done.append("step 3"), arrived.set()))
    worker.submit(lambda: done.append("land 4"), ready=lambda: True)
    fallback = threading.Timer(10.0, arrived.set)
    fallback.start()
    queued.set()
    worker.wait()
    fallback.cancel()
    assert done.index("step 3") < done.index("land 2") and done[-1] == "land 4", done


def test_a_step_error_of_the_worker_is_raised_where_that_step_is_waited_for():
    # a unit's step failing on the worker raised at whichever wait came next, which depends on when it failed: the end
    # of backward's wait for the landings on one rank, optimizer.step() or the next forward's gather of a unit stepped
    # before it on another, each followed by different collectives (a hang); and what was queued after it ran once
    # the error had been raised
    import threading

    import torch

    from lightning_shard.engine.optim.host_worker import HostWorker

    worker, done, failed = HostWorker(torch.device("cpu")), [], threading.Event()

    def fail() -> None:
        failed.set()
        raise ValueError("the step of unit 2 failed")

    worker.submit(lambda: done.append(1), key=1)
    worker.submit(fail, key=2)
    worker.submit(lambda: done.append(3), key=3)
    worker.submit(lambda: done.append("landing"), ready=failed.is_set)  # (held back until the step failed)
    worker.wait(lands_only=True)  # the end of backward: a step's error is not raised here
    worker.wait_for(lambda: 1 in done)  # stepped before the failure: nothing to raise
    with pytest.raises(ValueError, match="unit 2 failed"):
        worker.wait_for(lambda: 3 in done)
    worker.wait()
    assert done == [1], done  # what was queued after the failure was dropped


def test_the_end_of_backward_waits_for_the_landings_not_for_a_step_running():
    # it waited while the worker was busy: with each landing queueing its unit's step, for every step, one after another
    import threading
    import time

    import torch

    from lightning_shard.engine.optim.host_worker import HostWorker

    worker, started, release, landed = HostWorker(torch.device("cpu")), threading.Event(), threading.Event(), []
    worker.submit(lambda: landed.append("land"), ready=lambda: True)
    worker.submit(lambda: (started.set(), release.wait(10)), key=0)  # a step running until released
    assert started.wait(10)
    begun = time.monotonic()
    worker.wait(lands_only=True)
    waited = time.monotonic() - begun
    release.set()
    worker.wait()
    assert landed == ["land"] and waited < 5, waited


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_frozen_units_are_copied_once_under_offload(offload):
    # a frozen base's copies were made again after every optimizer step (a host cast, and under "optimizer" a copy
    # to the device, per frozen unit per step), though no optimizer writes what has no gradient
    report = run_world(scenarios.frozen_units_move_nothing, 2, offload, timeout=400)[0]
    assert report["differ"] == [], report
    copies = report["copies"]
    frozen = [name for name in copies if name.endswith(("blocks.0", "blocks.1"))]
    assert len(frozen) == 2 and all(copies[name] == 1 for name in frozen), copies
    assert all(copies[name] > 1 for name in copies if name not in frozen), copies


def test_a_landing_whose_readiness_check_fails_raises_instead_of_hanging():
    # a CUDA error (a device-side assert in backward) makes the event query of a gradient's copy raise: it killed the
    # worker thread, and the host waited for it forever (the end of backward, the undo of a failed step)
    import threading

    import torch

    from lightning_shard.engine.optim.host_worker import HostWorker

    def failed() -> bool:
        raise RuntimeError("CUDA error: device-side assert triggered")

    def land() -> None:  # the landing's own wait for the copy raises the same error
        failed()

    worker, outcome, release = HostWorker(torch.device("cpu")), [], threading.Event()
    worker.submit(release.wait)  # busy while a step and the landing queue behind it: the landing's check runs next
    worker.submit(lambda: None)
    worker.submit(land, ready=failed)
    release.set()

    def wait() -> None:
        try:
            worker.wait()
        except RuntimeError as err:
            outcome.append(str(err))

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    waiting.join(10)
    assert outcome == ["CUDA error: device-side assert triggered"], "the host still waits for the worker"


def test_setup_says_why_the_step_does_not_overlap():
    # a hook between backward and step (gradient norms logged in on_before_optimizer_step, Lightning's own recipe)
    # turned the overlap off without a word: the step took the serial time
    from types import SimpleNamespace

    import lightning as L

    from lightning_shard.lightning.offload_overlap import not_overlapped

    class Logs(L.LightningModule):
        def on_before_optimizer_step(self, optimizer):
            pass

    class Watches(L.Callback):
        def on_after_backward(self, trainer, pl_module):
            pass

    def trainer(module, callbacks=(), algorithm=None):
        return SimpleNamespace(lightning_module=module, callbacks=list(callbacks), gradient_clip_val=1.0,
                               gradient_clip_algorithm=algorithm)

    assert not_overlapped(trainer(L.LightningModule()), "bf16-mixed") is None
    assert not_overlapped(trainer(Logs(), [Watches()]), "bf16-mixed") == (
        "on_before_optimizer_step, Watches.on_after_backward run between backward and step")
    assert "16-mixed" in not_overlapped(trainer(L.LightningModule()), "16-mixed")
    assert "'value'" in not_overlapped(trainer(L.LightningModule(), algorithm="value"), "32-true")


def test_the_host_steps_cpu_threads_leave_two_cores_and_can_be_chosen(monkeypatch):
    # on a GPU machine torch's pool on every core, spinning between the step's kernels, delays the backward it overlaps
    import os

    from lightning_shard.engine.optim.host_worker import host_step_threads

    monkeypatch.delenv("LIGHTNING_SHARD_HOST_STEP_THREADS", raising=False)
    assert host_step_threads() == max(1, len(os.sched_getaffinity(0)) - 2)
    monkeypatch.setenv("LIGHTNING_SHARD_HOST_STEP_THREADS", "0")
    assert host_step_threads() is None  # torch's own count
    monkeypatch.setenv("LIGHTNING_SHARD_HOST_STEP_THREADS", "3")
    assert host_step_threads() == 3
    monkeypatch.setenv("LIGHTNING_SHARD_HOST_STEP_THREADS", "many")
    with pytest.raises(ValueError, match="LIGHTNING_SHARD_HOST_STEP_THREADS must be a whole number"):
        host_step_threads()
