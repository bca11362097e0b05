"""Exact or loud: habits of real models trained like DDP, or refused at once with the cause (issue 14)."""

from __future__ import annotations

import pytest
import torch

from tests import exactness_scenarios as scenarios
from tests import optimizer_scenarios, routed_scenarios, trainable_scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("world,mode,elide", [(2, "full", False), (2, "full", True), (2, "grad_op", False),
                                              (2, "none", False), (3, "full", True)])
def test_parameters_used_on_some_ranks_match_ddp(world, mode, elide):
    results = run_world(scenarios.branches, world, mode, elide, timeout=300)
    assert results[0]["units"] == ["block", "gate", "moe", "<root>"]
    # the data leaves some expert without a token on every rank: it keeps grad=None, as under DDP
    assert results[0]["never_used_experts"]


@pytest.mark.parametrize("mode", ["full", "grad_op"])
def test_a_backward_that_raised_leaves_the_next_steps_exact(mode):
    assert run_world(scenarios.failed_backward, 2, mode, timeout=300) == [1, 1]


def test_autograd_inplace_check_holds_by_default():
    assert run_world(scenarios.inplace_on_saved, 2, timeout=200) == [True, True]


def test_sparse_saved_tensors_with_elision():
    assert run_world(scenarios.sparse_saved_tensor, 2, timeout=200) == [True, True]


def test_unknown_optimizers_are_refused_naming_how_to_declare_them():
    # one world for the five cases (a world's start costs more than a case)
    refusals = run_world(optimizer_scenarios.optimizer_refusals, 1, timeout=200)[0]
    message, lbfgs, elementwise, matrix, adafactor = refusals
    assert "MyAdamW is not known to lightning_shard" in message
    assert "elementwise_optimizers=[MyAdamW]" in message and "matrix_optimizers=[MyAdamW]" in message
    assert "torch.optim.LBFGS cannot be sharded: it re-evaluates the loss" in lbfgs
    assert (elementwise, matrix, adafactor) == ("trained", "trained", "trained")


def test_optimizer_options_are_checked():
    from lightning_shard import ShardStrategy

    with pytest.raises(ValueError, match="`elementwise_optimizers` must be a list of torch.optim.Optimizer"):
        ShardStrategy(elementwise_optimizers=["AdamW"])
    with pytest.raises(ValueError, match="`matrix_optimizers` must be a list of torch.optim.Optimizer"):
        ShardStrategy(matrix_optimizers=[object])
    with pytest.raises(ValueError, match="an optimizer is one or the other"):
        ShardStrategy(elementwise_optimizers=[torch.optim.SGD], matrix_optimizers=[torch.optim.SGD])
    with pytest.raises(ValueError, match="`step_group_size` must be an int >= 1"):
        ShardStrategy(step_group_size=0)


@pytest.mark.parametrize("mode", ["full", "none"])
def test_two_backwards_through_a_unit_called_twice(mode):
    assert run_world(scenarios.two_backwards, 2, mode, timeout=200) == [True, True]


def test_a_second_backward_through_the_root_units_weights():
    assert run_world(scenarios.two_backwards, 2, "full", True, timeout=200) == [True, True]


def test_a_units_backward_on_some_ranks_only_is_an_error_not_a_silent_swap():
    with pytest.raises(AssertionError) as failure:
        run_world(scenarios.aux_on_some_ranks, 2, timeout=200)
    assert str(failure.value).count("ranks reduced the units' gradients in different orders") == 2


@pytest.mark.parametrize("case", ["train", "frozen", "inputs", "eval"])
def test_units_run_on_some_ranks_only_are_an_error_not_a_silent_swap(case):
    """Each rank routed to another expert held in a unit of its own: the experts' all-gathers are alike, so each
    rank would compute with the other's shards. Frozen experts reduce nothing, and evaluation runs no backward:
    the ranks compare the units they gathered at the end of each backward and of each step without one."""
    errors = run_world(routed_scenarios.experts_of_their_own, 2, case, timeout=200)
    assert all(e.startswith("lightning_shard: the ranks all-gathered different units") for e in errors), errors
    assert run_world(routed_scenarios.experts_of_their_own, 2, "same", timeout=200) == ["computed True"] * 2


@pytest.mark.parametrize("grad", [False, True])
def test_a_step_raising_on_one_rank_raises_there_at_once(grad):
    """Its own error, at once: not an agreement at the step's end that the other ranks never join, waited out
    until the process-group timeout and reported in place of the error."""
    results = run_world(routed_scenarios.raising_on_one_rank, 2, grad, timeout=200, pg_timeout=60)
    assert results[1][0] == "ValueError: a bad batch on rank 1" and results[1][1] < 20, results


def test_freezing_and_unfreezing_between_steps_trains_like_one_process():
    trainable = run_world(scenarios.in_modes, 2, trainable_scenarios.freeze_unfreeze, ["full", "grad_op"],
                          timeout=300)[0]
    assert trainable == [["backbone.1.0.weight", "backbone.1.0.bias"]] * 2


def test_ranks_that_freeze_different_parameters_are_told():
    with pytest.raises(AssertionError) as failure:
        run_world(trainable_scenarios.freeze_on_one_rank, 2, timeout=200)
    assert str(failure.value).count("ranks train different parameters") == 2


def test_gradient_norms_and_clipping_over_the_shards_match_one_process():
    assert run_world(scenarios.gradient_norms, 2, timeout=200) == [True, True]


def test_buffers_are_broadcast_like_ddp_and_saved_once():
    names = run_world(scenarios.buffers_like_ddp, 2, timeout=200)[1]
    assert names == sorted(f"{i}.norm.{b}" for i in (0, 1) for b in ("num_batches_tracked", "running_mean",
                                                                        "running_var"))


def test_toggle_optimizer_inside_a_step_trains_like_one_process():
    assert run_world(scenarios.in_modes, 2, trainable_scenarios.gan_toggling_inside_the_step, ["full", "grad_op"],
                     timeout=300) == [[True, True]] * 2


def test_a_forward_on_rank_0_only_outside_the_steps_runs_no_collective():
    assert run_world(scenarios.side_forward_on_rank_0, 2, timeout=120) == [True, True]


def test_one_rank_keeps_the_gradient_of_a_parameter_frozen_during_accumulation():
    """At one rank gradients go to the shards as they are (no reduction): one frozen between micro-batches of a
    `no_sync` accumulation keeps the gradient it got, and the optimizer steps it, as in plain torch (issue 52.3; it
    was dropped)."""
    import copy

    from lightning_shard.engine.shard_module import shard_module

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    model = copy.deepcopy(reference)
    runtime = shard_module(model, units=["Linear"])
    with runtime.shaped_parameters():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runtime.attach_optimizer(optimizer)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        first, second = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
        with runtime.no_sync():
            runtime.run_step(lambda: model(first).pow(2).mean()).backward()
        reference(first).pow(2).mean().backward()
        if step == 0:  # frozen after a micro-batch gave it a gradient: that gradient is kept, and stepped
            model[0].weight.requires_grad_(False)
            reference[0].weight.requires_grad_(False)
        runtime.run_step(lambda: model(second).pow(2).mean()).backward()
        reference(second).pow(2).mean().backward()
        runtime.step(optimizer)
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        model[0].weight.requires_grad_(True)
        reference[0].weight.requires_grad_(True)
    from lightning_shard.checkpoint.full import full_state_dict

    state = full_state_dict(runtime, rank0_only=False)
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
