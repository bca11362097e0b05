"""Writes to parameters outside the optimizer (issue 49): weight constraints and momentum teachers, against one
process on the same global batches (rtol 1e-5, atol 1e-6)."""

from __future__ import annotations

import pytest
import torch

from tests import weight_write_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)

WHERE = ["on_before_zero_grad", "after_manual_step", "between_steps", "in_forward"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_weight_constraint_is_kept_wherever_it_is_written(world):
    """WGAN's `p.data.clamp_()` after a step's forward (Lightning's on_before_zero_grad, which README advises), after a
    manual step, between steps, or inside a forward: written into a unit's gathered copy it was lost at 2 ranks (0.2
    off); it lands in the shards now, written back when the copy is freed or before the optimizer steps."""
    shardings = ["full"] if world == 1 else ["full", "grad_op", "none"] if world == 2 else ["full", "grad_op"]
    cases = [(sharding, where) for sharding in shardings for where in WHERE]
    assert run_world(scenarios.constraint, world, cases, timeout=300) == [cases] * world


@pytest.mark.parametrize("sharding", ["full", "grad_op"])
def test_the_readme_advice_on_constraints_holds_through_the_trainer(sharding):
    """on_before_zero_grad clipping, accumulate_grad_batches=2, nonfinite="skip" with an infinite micro-batch: the
    weights of one process in Lightning's order (the whole step with that micro-batch skipped)."""
    assert run_world(scenarios.lightning_wgan, 2, sharding, timeout=300) == [{"skipped": 1, "steps": 3}] * 2


def test_a_momentum_teacher_updated_in_place_or_by_data_assignment_trains_like_one_process():
    """Student and teacher laid out alike ("Encoder": each a unit), the teacher updated after the step (BYOL, DINO),
    before the student's forward (MoCo v3) or between the two forwards (MoCo v2, the teacher's all-gather in flight:
    gathered again), with `t.mul_(m).add_(s)` or `t.data = ...` (adopted into the shard at the next gather: it was
    ignored, the gathers reading the old shard). Heads left in the root unit ("Block"): exact inside the step, where
    the root is whole; between steps a warning at setup names the pair."""
    cases = [(sharding, units, when, rebind) for sharding in ("full", "grad_op") for units in ("Encoder", "Block")
             for when in (None, "first", "between") for rebind in (False, True)
             if not (units == "Block" and when is None) and not (sharding == "grad_op" and when == "between")]
    done = run_world(scenarios.momentum, 2, cases, timeout=300)[0]  # (rank 0 warns)
    assert [case[:4] for case in done] == cases
    assert all(warned == (units == "Block") for _, units, _, _, warned in done), done


def test_a_teacher_laid_out_otherwise_is_named_at_setup_and_its_update_between_steps_fails():
    """Both heads in the root unit, at other offsets: their 1-D shards are other elements, of other lengths."""
    results = run_world(scenarios.misaligned_teacher, 2, timeout=120, pg_timeout=30)
    assert all("must match the size of tensor b" in r for r in results), results


def test_written_back_under_bf16_masters_keep_their_precision_where_nothing_wrote():
    """Computing in bf16 over fp32 masters, a write-back takes only the elements that differ from the masters' cast:
    elsewhere the masters keep their fp32 bits (a copy of the bf16 buffer would round them at every free)."""
    from lightning_shard.engine.storage.flat_shard import FlatShard, ParamSlot

    values = torch.linspace(-1, 1, 12) * (1 + 2**-12)  # not representable in bf16
    slot = ParamSlot(("w",), (), torch.Size([3, 4]), 0, 12, True)
    storage = FlatShard([slot], values.clone(), rank=0, world_size=1, param_dtype=torch.bfloat16)
    buffer = storage.allocate()
    storage.fill_gathered(storage.gathered_data)
    buffer[5] = 0.5  # what a constraint wrote
    storage.write_back()
    expected = values.clone()
    expected[5] = 0.5
    assert torch.equal(storage.shard, expected)


def test_weights_clipped_through_data_in_a_lightning_fit_match_ddp_with_and_without_offload():
    """WGAN's `p.data.clamp_()` at the top of `training_step`, in `on_before_zero_grad`, or inside each block's forward,
    against DDP (32-true, 1e-6). At the top of training_step the first block's prefetch, issued as the step began,
    read its shard before the clamp, and its copy overwrote the clamped shard when freed (4e-2 off); offloaded, what
    was written into a gathered copy (the root's, a block's in its forward) never reached the master (4.1 off), and
    the overlapped step stepped the root before its write-back."""
    cases = [(where, offload, overlap) for where in ("training_step", "on_before_zero_grad", "in_forward")
             for offload, overlap in ((None, True), ("optimizer", True), ("optimizer", False), ("params", True))]
    report = run_world(scenarios.lightning_constraints, 2, cases, timeout=500)[0]
    assert all(diff <= 1e-6 for diff in report.values()), report
