"""Per-rank memory: parameters, gradients and optimizer state are 1/N of the model (plus padding)."""

import pytest

from tests.engine_scenarios import memory
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world_size, prefetch", [(2, 0), (2, 2), (3, 1)])
def test_full_sharding_holds_one_nth_per_rank(world_size, prefetch):
    for r in run_world(memory, world_size, "full", prefetch):
        share = r["unsharded"] / world_size
        slack = r["padding"]  # at most world_size - 1 elements per unit
        assert share <= r["param"] <= share + slack, r
        assert share <= r["grad"] <= share + slack, r
        assert 2 * share <= r["state"] <= 2 * (share + slack), r  # AdamW: exp_avg and exp_avg_sq
        # besides the root unit: the unit computing plus `prefetch` gathered ahead, never more
        assert r["max_alive"] == prefetch + 1, r
        # nothing stays gathered after a step
        assert r["after_step"] == 0, r


def test_no_sharding_holds_the_whole_model():
    for r in run_world(memory, 2, "none"):
        assert r["param"] == r["unsharded"] + r["padding"], r


def test_zero_grad_frees_the_gradient_shards_and_partial_clears_stay_exact():
    """The engine holds gradient shards only through the parameters' ``.grad``: ``zero_grad(set_to_none=True)``
    frees them (the next backward does not build new ones beside the old), and clearing some parameters' ``.grad``
    only (an optimizer over some of them) accumulates the others exactly. One process, the reduction at world 1."""
    import copy
    import weakref

    import torch

    from lightning_shard.engine.shard_module import shard_module
    from tests import models

    torch.manual_seed(0)
    model = models.TinyGPT()
    reference = copy.deepcopy(model)
    runtime = shard_module(model)
    batch = models.TinyGPT.batch(torch.Generator().manual_seed(1), 4)
    for net in (model, reference):
        models.TinyGPT.loss(net, batch, 0).backward()
        for i, p in enumerate(net.parameters()):
            if i % 2:
                p.grad = None
        models.TinyGPT.loss(net, batch, 1).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad.reshape(-1), rtol=1e-6, atol=1e-7, msg=name)
    # at one rank each gradient is handed to its shard as it is (no flat buffer): nothing else may hold it
    held = [weakref.ref(p.grad) for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    assert all(ref() is None for ref in held)
    assert all(unit.storage.shard_grad is None for unit in runtime.units)
