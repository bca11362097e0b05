"""DeepSpeed ZeRO-3's own test scenarios (issue 52) at 2 gloo ranks, against DDP or one process on the same global
batch (float32: rtol 1e-5, atol 1e-6), or refused on every rank with an error naming the cause."""

from __future__ import annotations

import pytest

from tests import zero3_scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(400)


def test_a_unit_returning_its_own_parameter_trains_like_ddp_and_what_it_returned_stays_readable():
    """Megatron's ``(output, self.bias)``, and the same inside a plain object (DeepSpeed's test_ext_param_returnobj):
    the caller got a view of the gathered buffer the unit then freed, and both ranks died of a segfault."""
    assert run_world(zero3_scenarios.returns_own_parameter, 2, timeout=300) == [True, True]


def test_a_parent_reading_a_child_units_parameter_gathers_it_and_trains_like_ddp():
    """DeepSpeed's external parameters, read after the child ran and before it runs: it was torch's shape error on
    a 1-D shard. What it costs under ``full``: linear1 (112 parameters) gathered a second time for the read after
    it ran; linear2, gathered for the read before it runs, serves its own call; neither is gathered again in
    backward, kept gathered to its end."""
    stats = run_world(zero3_scenarios.external_parameters, 2, timeout=300)[0]
    unit_bytes = {"linear1": (6 * 16 + 16) * 4, "linear2": (16 * 16 + 16) * 4, "head": 18 * 4}  # head: 17, padded
    once = sum(unit_bytes.values())
    assert stats["grad_op"]["all_gather_bytes"] == once
    assert stats["full"]["all_gather_bytes"] == once + unit_bytes["linear1"]
    assert stats["none"]["all_gather_bytes"] == 0


def test_parameters_frozen_between_micro_batches_keep_their_earlier_gradients_like_plain_torch():
    """Under ``no_sync`` the gradients the biases got in the first micro-batch were dropped when they were frozen for
    the next (``no_replica_sync`` refused it): plain torch keeps and steps them. Every sharding and deferral, the
    biases or a whole unit frozen."""
    assert run_world(zero3_scenarios.frozen_between_micro_batches, 2, timeout=380) == [True, True]


def test_writes_inside_keep_gathered_are_written_back_from_the_modifier_rank_or_refused():
    for report in run_world(zero3_scenarios.writes_inside_keep_gathered, 2, timeout=300):
        assert "['linears.0.weight'] were written inside keep_gathered()" in report["refused"], report
        assert "keep_gathered(modifier_rank=0)" in report["refused"]
        assert "['linears.2.bias']" in report["refused_data_write"], report
        assert report["bf16_exact"]
        assert report["bad_rank"] == ("ValueError: lightning_shard: keep_gathered(modifier_rank=...) takes a rank of the"
                                      " runtime's group, 0 to 1 (or None: writes refused); got 2."), report["bad_rank"]


def test_double_sharding_lazy_modules_and_tensors_outside_the_model_are_refused_by_name():
    for report in run_world(zero3_scenarios.refused_at_setup, 2, timeout=300):
        assert report["nested"].startswith("ValueError: lightning_shard: submodules ['inner'] of this model are"
                                           " sharded already"), report["nested"]
        assert report["shared"].startswith("ValueError: lightning_shard: parameters ['inner.0.weight',"), report
        assert "by the runtime of another model this one shares modules with" in report["shared"]
        assert report["lazy"].startswith("ValueError: lightning_shard: ['0'] are lazy modules not initialised"), report
        assert report["added"].startswith("ValueError: lightning_shard: SGD holds 'extra.weight' (registered after"
                                          " sharding), 'extra.bias'"), report["added"]
        assert "a tensor of shape (3,) outside the model" in report["added_group"], report["added_group"]


def test_consolidate_from_one_rank_inside_a_running_job_runs_no_collective(tmp_path):
    """Its docstring says it needs no process group; it ran its integrity check's exchange over the default group, and
    waited there for a rank that never came (a timeout, or a CollectiveError once that rank exited)."""
    from lightning_shard.checkpoint.consolidate import consolidate

    consolidated = run_world(zero3_scenarios.consolidate_on_one_rank, 2, str(tmp_path), timeout=200, pg_timeout=30)[0]
    alone = consolidate(tmp_path / "model.ckpt")["state_dict"]  # here: a process without a process group
    assert consolidated.keys() == alone.keys() == {f"{m}.{p}" for m in ("inner.0", "inner.2", "head")
                                                   for p in ("weight", "bias")}
    assert all(consolidated[k].equal(alone[k]) for k in alone)
