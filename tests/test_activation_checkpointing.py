"""Activation checkpointing per unit: same results as DDP, one gather per unit in backward for both the
recomputation and the backward, bad choices refused at construction or setup."""

import copy

import pytest
import torch
import torch.utils.checkpoint

from lightning_shard import ShardStrategy, shard_module
from tests import engine_scenarios, models
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("scenario", ["gpt_checkpointed", "gpt_checkpointed_inner"])
def test_same_results_as_ddp(scenario):
    run_world(engine_scenarios.parity, 2, scenario, ("full", "grad_op", "none"), 6)


def test_recomputation_and_backward_share_one_gather():
    report = run_world(engine_scenarios.backward_gathers, 2, "untied_checkpointed")[0]
    on, off = report[True], report[False]
    assert on["losses"] == off["losses"]
    steps = len(on["losses"])
    # the embedding saves no weight, but its recomputation needs it: gathered in backward, exactly once
    for unit in ("wte", "blocks.0", "blocks.1"):
        assert on["per_unit"][unit]["all_gather"] == 2 * steps, (unit, on["per_unit"][unit])
        assert on["per_unit"][unit]["skip_gather"] == 0
    # the last unit stays gathered from its forward into backward once the order is known (after step 1)
    assert on["per_unit"]["blocks.2"]["all_gather"] == steps + 1
    assert on["skipped_per_step"] == [0] * steps


def test_checkpointed_run_matches_plain_run_bit_for_bit():
    def run(checkpointing):
        torch.manual_seed(0)
        model = models.TinyGPT()
        shard_module(model, activation_checkpointing=checkpointing)
        batch = models.TinyGPT.batch(torch.Generator().manual_seed(0), 4)
        models.TinyGPT.loss(model, batch, 0).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = run(False), run(True)
    assert plain.keys() == checkpointed.keys() and plain
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name


@pytest.mark.parametrize("bad", [3, "", [], [3], {"Block": 1}])
def test_bad_choice_is_refused_at_construction(bad):
    with pytest.raises((ValueError, TypeError), match="activation_checkpointing"):
        ShardStrategy(activation_checkpointing=bad)


def test_module_holding_a_unit_or_matching_nothing_is_refused():
    with pytest.raises(ValueError, match=r"'blocks' \(ModuleList\) contains unit 'blocks.0'"):
        shard_module(models.TinyGPT(), units=["Block"], activation_checkpointing=["ModuleList"])
    with pytest.raises(ValueError, match="matches no module"):
        shard_module(models.TinyGPT(), activation_checkpointing=["Conv2d"])


class _CheckpointedBlock(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(6)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(6, 18), torch.nn.GELU(), torch.nn.Linear(18, 6))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a submodule checkpointed by the user, not the engine
        return x + torch.utils.checkpoint.checkpoint(self.mlp, self.ln(x), use_reentrant=self.reentrant)


class _Stack(torch.nn.Module):
    def __init__(self, reentrant: bool, stop_gradient_call: bool) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(5, 6)
        self.blocks = torch.nn.ModuleList(_CheckpointedBlock(reentrant) for _ in range(3))
        self.stop_gradient_call = stop_gradient_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        if self.stop_gradient_call:  # a block called again under no_grad (a target), after its call with grad
            with torch.no_grad():
                target = self.blocks[1](h.flip(0))
            h = h - target
        return h.pow(2).mean()


@pytest.mark.parametrize("case", ["reentrant_last", "no_grad_call", "retain_graph_twice", "two_graphs"])
def test_one_rank_recomputations_find_their_units_gathered(case):
    """At one rank a unit computing in its shards has nothing to free before backward ends, but whatever resharded it
    in between (a nested backward's end, a forward under no_grad, an earlier backward) must not leave a recomputation
    reading 1-D shards: the same gradients as without sharding, bit for bit."""
    torch.manual_seed(0)
    sharded = _Stack(reentrant=case == "reentrant_last", stop_gradient_call=case == "no_grad_call")
    plain = copy.deepcopy(sharded)
    shard_module(sharded, units=["_CheckpointedBlock"])
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    for model in (plain, sharded):
        if case == "retain_graph_twice":
            loss = model(x)
            loss.backward(retain_graph=True)
            loss.backward()
        elif case == "two_graphs":
            first, second = model(x), model(y)
            first.backward()
            second.backward()
        else:
            model(x).backward()
    for (name, got), (_, want) in zip(sharded.named_parameters(), plain.named_parameters()):
        assert torch.equal(got.grad, want.grad.reshape(-1)), name
