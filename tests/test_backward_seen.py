"""How the runtime sees a backward begin: every unit's gradients reduced like DDP's however the backward reaches
them, or an error before the optimizer steps without them."""

from __future__ import annotations

import pytest
import torch

from tests import backward_seen_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("mode", ["full", "grad_op"])
def test_a_backward_inside_the_step_through_root_parameters_only_matches_ddp(mode):
    assert run_world(scenarios.root_only_manual_backward, 2, mode, timeout=200) == [True, True]


@pytest.mark.parametrize("mode", ["grad_op", "none"])
def test_a_unit_whose_output_autograd_cannot_see_matches_ddp(mode):
    assert run_world(scenarios.boxed_output, 2, mode, timeout=200) == [True, True]


@pytest.mark.parametrize("case", ["aux alone", "no_sync"])
def test_a_gradient_no_reduction_took_stops_the_optimizer_step_on_every_rank(case):
    messages = run_world(scenarios.unseen_gradients_refused, 2, case, timeout=200)
    for message in messages:
        assert "holds a gradient that was never reduced across ranks" in message, message
        assert "'1.aux_head.weight'" in message or "'1.aux_head.bias'" in message or case == "no_sync", message


@pytest.mark.parametrize("case", ["penalty alone", "penalty after the loss", "twice, two backwards"])
@pytest.mark.parametrize("world", [1, 2])
def test_backwards_that_reach_a_unit_other_than_through_its_outputs_match_ddp(case, world):
    for mode in ("full", "grad_op", "none"):
        assert run_world(scenarios.separate_backwards, world, mode, case, timeout=200) == [True] * world, mode


def test_each_backward_of_several_in_one_step_frees_units_as_it_goes():
    peaks = run_world(scenarios.micro_batches_in_one_step, 2, timeout=200)[0]
    assert peaks[1] == peaks[2] == peaks[0], peaks


@pytest.mark.parametrize("case", ["penalty alone", "penalty after the loss"])
def test_a_penalty_backpropagated_on_its_own_recomputes_checkpointed_units_gathered(case):
    for mode in ("full", "grad_op", "none"):
        assert run_world(scenarios.separate_backwards, 2, mode, case, 2, True, timeout=200) == [True, True], mode


def test_an_auxiliary_loss_kept_on_a_freed_unit_fails_with_an_explanation():
    """A unit keeping a loss computed from its output (``self.aux = head(out)``), which its caller adds: that term's
    backward reads the unit's weights before the hook on its outputs gathers it again. Torch's words (a storage of size
    0) come with ours. One rank in bf16-mixed frees the unit's bf16 copy after forward, as ``full`` does at any world."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard import ShardStrategy
    from tests.world import one_rank_here

    trainer = L.Trainer(strategy=ShardStrategy(units=["AuxFromOutput"]), accelerator="cpu", devices=1, max_steps=1,
                        precision="bf16-mixed", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(4, 8)), batch_size=4)
    with one_rank_here(), pytest.raises(RuntimeError, match="backward read the parameters of a unit freed after its"
                                                           " forward.*Return that tensor from the unit's forward"):
        trainer.fit(scenarios.KeepsAuxOfOutput(), data)
