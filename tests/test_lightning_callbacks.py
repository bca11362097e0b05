"""Lightning's own callbacks and habits under ShardStrategy at 2 CPU ranks (issue 53; the Lightning faces of issue 52's
refusals): pruning refused by name, consolidation from rank 0 inside the job, Lightning's grad_norm of shards told."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

APP = os.path.join(os.path.dirname(__file__), "callbacks_app.py")
pytestmark = pytest.mark.timeout(600)


def run_app(tmp_path, scenario: str) -> dict:
    proc = subprocess.run([sys.executable, APP, "--out", str(tmp_path), "--scenario", scenario], capture_output=True,
                          text=True, timeout=500, env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {**torch.load(tmp_path / "results.pt", weights_only=True), "log": proc.stdout + proc.stderr}


def test_pruning_and_what_cannot_be_sharded_are_refused_by_name_on_every_rank(tmp_path):
    """ModelPruning pruned each rank's 1-D shard with its own threshold and the result was lost silently (0 zeros of
    1124, ddp 562); pruning applied during fit crashed in torch's prune hook or in a checkpoint. Each is one error on
    both ranks, at setup where it can be, and a fit after them runs (no rank was left waiting in a collective)."""
    errors = run_app(tmp_path, "refused")["errors"]
    assert errors["ModelPruning"].startswith("ValueError: lightning_shard: ['ModelPruning'] prune with"
                                             " torch.nn.utils.prune"), errors["ModelPruning"]
    assert errors["pruned during fit"].startswith("RuntimeError: lightning_shard: 'net.2.weight' is sharded; removing"
                                                  " it from its module, as torch.nn.utils.prune's"), errors
    assert errors["pruned before fit"].startswith("ValueError: lightning_shard: ['net.2.weight'] carry"
                                                  " torch.nn.utils.prune reparametrizations"), errors
    assert errors["added in configure_optimizers"].startswith("ValueError: lightning_shard: AdamW holds 'extra.weight'"
                                                              " (registered after sharding)"), errors
    assert errors["lazy"].startswith("ValueError: lightning_shard: ['net.0'] are lazy modules"), errors


def test_consolidate_on_rank_0_after_fit_while_the_other_rank_waits_or_exits(tmp_path):
    """``if trainer.is_global_zero: consolidate(best_model_path)``: a CollectiveError once the other rank exited, a
    wait until the process-group timeout while it waited in a barrier. Now the state a separate process gets."""
    from lightning_shard.checkpoint.consolidate import consolidate

    results = run_app(tmp_path, "consolidate")
    alone = consolidate(results["best"])["state_dict"]
    assert len(alone) == 6
    for when in ("waiting", "exited"):
        assert results[when].keys() == alone.keys()
        assert all(results[when][k].equal(alone[k]) for k in alone), when


def test_lightnings_grad_norm_of_the_shards_is_told_once_and_the_strategys_matches_ddp(tmp_path):
    """Lightning's ``grad_norm(self)`` logged each rank's shard norms (0.861 and 1.695 against ddp's 1.901) silently."""
    results = run_app(tmp_path, "grad_norm")
    assert results["log"].count("look like Lightning's `grad_norm(module, norm_type)`") == 1
    assert len(results["sharded"]) == len(results["ddp"]) == 4
    for ours, ddp in zip(results["sharded"], results["ddp"]):
        assert ours.keys() == ddp.keys()
        for key in ddp:
            assert ours[key] == pytest.approx(ddp[key], rel=1e-5), key
