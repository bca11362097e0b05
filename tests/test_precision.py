"""Mixed precision: fp32 masters, bf16 gathers and compute, fp32 reduction; a scaler that agrees."""

import copy

import pytest
import torch

from lightning_shard import shard_module
from tests import models
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


def test_one_rank_in_bf16_hands_over_the_bf16_gradients_cast_to_fp32():
    """One rank, computing in bf16: each unit's gradients are cast in one flat copy as its backward ends. They must be
    the gradients of the model in bf16, cast to fp32, exactly; a frozen parameter gets none."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    model.blocks[1].ln2.weight.requires_grad_(False)
    reference = copy.deepcopy(model).to(torch.bfloat16)
    shard_module(model, param_dtype=torch.bfloat16)
    ids = torch.randint(0, 37, (2, 5))
    for net in (reference, model):
        net(ids).float().mean().backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and "blocks.1.ln2.weight" not in got
    for name, grad in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], grad.float().reshape(-1)), name


def test_a_retained_graph_runs_backward_again_with_its_units_gathered_again():
    """Computing in bf16 the end of backward frees every unit, the root's too: a second backward through the retained
    graph gathers them again (the root when the step's output gets its gradient), and adds the same gradients."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    shard_module(model, param_dtype=torch.bfloat16)
    loss = model(torch.randint(0, 37, (2, 5))).float().mean()
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, 2 * once[name]), name


def test_gradients_accumulate_the_same_when_backward_creates_a_graph():
    """One rank computing in bf16 casts a unit's gradients into a flat buffer, which requires grad under
    ``create_graph=True``: a parameter's first gradient, added to the others' in that buffer, must not be an in-place
    change autograd refuses (a ``split()`` view's was), nor differ from the same backwards without a graph."""
    plain = run_world(scenarios.accumulation_with_create_graph, 1, False)[0]
    graphed = run_world(scenarios.accumulation_with_create_graph, 1, True)[0]
    assert plain.keys() == graphed.keys() == {"a.weight", "a.bias", "b.weight", "b.bias"}
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(graphed[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("policy", [{"unit_size": 200}, {"units": ["NormBlock"], "activation_checkpointing": True}],
                         ids=["packed", "checkpointed-blocks"])
def test_batch_norms_compute_in_fp32_units_under_bf16_autocast(policy):
    assert run_world(scenarios.batch_norm_under_bf16_autocast, 2, policy, timeout=200) == [True, True]


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_micro_batches_under_no_sync_are_summed_in_fp32_like_ddp(world):
    """Summed in the bf16 gathered parameters' .grad they were 1.5e-3 (world 1) and 1.8e-2 (world 2) off after three
    Adam steps, relative to each parameter's scale; in fp32 (unsharded_grads.py) as DDP and FSDP2 sum them."""
    for worst in run_world(scenarios.bf16_no_sync_accumulation, world, ["full", "grad_op"], timeout=200):
        assert max(worst) < 1e-6, worst
