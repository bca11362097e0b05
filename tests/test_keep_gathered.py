"""Evaluation and generation with every unit held gathered (issue 18): one all-gather per unit on entry, no
collective inside, so ranks may generate different numbers of tokens; the same numbers as one process; a
forward with gradients inside is refused; training goes on after it like DDP."""

from __future__ import annotations

import pytest
import torch

from tests import eval_scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


def test_generation_to_different_lengths_with_units_held():
    for report in run_world(eval_scenarios.generate_different_lengths, 2, timeout=240):
        assert report["gathers_at_entry"] == report["units"]  # one all-gather per unit, the root included
        assert report["collectives_inside"] == 0  # rank 0 generates 2 tokens, rank 1 five: nothing to wait for
        assert report["tokens_equal"] and report["logits_close"]  # greedy decoding as with the unsharded weights
        assert report["freed"]  # released on exit
        assert "keep_gathered" in report["grad_forward"]  # training inside is refused, not run on held units
        assert report["regathered_bytes"] > 0  # what holding saves: without it every token gathers every unit
        losses, expected = report["losses_after"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_a_model_called_below_the_root_outside_any_step_trains_and_generates():
    """A call entering below the root (the root unit's own modules, or a module above them: ``self.model`` of a
    LightningModule) gathers the root unit for itself, as a call of the root does."""
    for report in run_world(eval_scenarios.called_below_the_root, 2, timeout=240):
        assert report["raised"]  # and recovered from, as a call of the root does
        losses, expected = report["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        assert report["tokens_equal"] and report["logits_close"] and report["freed"], report



def test_a_backward_inside_the_hold_reduces_and_keeps_the_units_gathered_like_ddp():
    """A loss computed before ``keep_gathered()`` and backpropagated inside it (generation between a policy's loss and
    its backward) left the held units freed: the next forward inside failed with a raw torch error."""
    for report in run_world(eval_scenarios.backward_inside_the_hold, 2, timeout=240):
        assert report["tokens_equal"] == [True] * 3, report
        assert report["max_diff"] < 1e-6, report
        assert report["freed"], report
