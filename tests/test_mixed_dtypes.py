"""Units whose parameters differ in dtype (issue 48): Hugging Face's usual LoRA recipe, a base loaded in bf16 with
peft's adapters in fp32, trains under ShardStrategy as under DDP. Before, its units were refused ("mixes dtypes")."""

from __future__ import annotations

import pytest
import torch

from tests import mixed_paths_scenarios as paths
from tests import mixed_scenarios as scenarios
from tests.world import run_world

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "base"
    scenarios.write_base(str(folder))
    return folder


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_base_with_fp32_lora_adapters_matches_ddp(base, world):
    results = run_world(scenarios.lora_against_ddp, world, str(base), ["32-true", "bf16-mixed"], timeout=500)
    for r in results[0]:
        tag = f"{r['precision']} on {world} ranks"
        assert r["mixed_units"] == 2, tag  # the decoder layers: bf16 base weights and norms, fp32 adapters
        # the same batches, the same kernels in the same dtypes: on 2 ranks the averaged gradients are DDP's to the
        # bit (a + b either way), so are the losses and the adapters after 5 AdamW steps; on 3 ranks the fp32 sum of
        # three gradients is taken in another order (measured: losses equal, adapters within 1.1e-7)
        losses, ddp = torch.tensor(r["losses"]), torch.tensor(r["ddp_losses"])
        assert len(losses) == scenarios.STEPS, tag
        assert set(r["adapters"]) == set(r["ddp_adapters"]) and len(r["adapters"]) == 8, tag
        if world == 2:
            assert torch.equal(losses, ddp), (tag, losses, ddp)
            for key, value in r["ddp_adapters"].items():
                assert torch.equal(r["adapters"][key], value), (tag, key)
        else:
            torch.testing.assert_close(losses, ddp, rtol=1e-6, atol=0, msg=tag)
            for key, value in r["ddp_adapters"].items():
                torch.testing.assert_close(r["adapters"][key], value, rtol=1e-5, atol=1e-6, msg=f"{tag} {key}")
        for key, value in r["ddp_base"].items():  # the frozen base: untouched, and still bf16
            assert r["base"][key].dtype == torch.bfloat16 and torch.equal(r["base"][key], value), (tag, key)
        # a frozen bf16 base gets no fp32 master: the shards keep the dtypes the model chose; only adapters train
        assert r["held"] == {("torch.bfloat16", False): 21, ("torch.float32", True): 8}, (tag, r["held"])
        assert r["optimizer_dtypes"] == ["torch.float32"], tag
        # one all-gather per unit per gather, of its bytes in the dtypes it computes in (the base in bf16 under both
        # precisions, the adapters in bf16 under bf16-mixed): the first layer twice, the last (backward starts with
        # it) once, the root once
        layers = r["gather_bytes"][:2]
        assert r["stats"]["all_gather_bytes"] == 2 * layers[0] + layers[1] + r["root"], (tag, r["stats"])
        # backward reduces the adapters' gradients only, in fp32, spread over the ranks: each rank steps about 1/N
        # of them (within one adapter matrix), not the ranks that happen to hold q_proj and v_proj
        assert r["stats"]["reduce_scatter_bytes"] == 4 * world * sum(r["reduced_per_rank"]), (tag, r["stats"])
        stepped = [rank_results[results[0].index(r)]["stepped"] for rank_results in results]
        assert max(stepped) - min(stepped) <= r["largest_adapter"], (tag, stepped)
    assert [r["precision"] for r in results[0]] == ["32-true", "bf16-mixed"]


def test_the_estimate_counts_each_parameter_in_its_own_dtype(base):
    results = run_world(scenarios.estimate_by_dtype, 2, str(base), timeout=300)
    for key in ("params", "optimizer_state", "grads", "gathered"):  # planned before sharding as the engine lays out
        assert results[0]["planned"][key] == results[0]["read"][key], (key, results[0])
    planned = results[0]["planned"]
    # a bf16 base is held in bf16 (the shards of the busiest rank, and the root unit gathered all step), not in the fp32
    # an estimate in one master dtype counted (before: 2x the base)
    assert planned["params"] == max(r["held"] for r in results) < results[0]["fp32_everything"]
    # AdamW's two fp32 moments for this rank's adapter elements, and their fp32 gradient shards: nothing for the base
    assert planned["optimizer_state"] == max(r["state"] for r in results)
    assert planned["grads"] == max(r["grads"] for r in results)


def test_units_of_several_dtypes_under_every_sharding_match_one_process():
    cases = [("hybrid", 1), ("hybrid", 2), ("none", 1), ("grad_op", 1), ("full", 2)]
    # hybrid: 2 replicas of 2-rank shard groups (the adapters' gradient shards all-reduced across them; accumulating,
    # without it until the last micro-batch); the reference sums the same micro-batches in another order: fp32's
    # last bits (measured: within 4.3e-8)
    for differences in run_world(scenarios.sharding_modes, 4, cases, timeout=500):
        assert len(differences) == len(cases) and max(differences) < 1e-6, differences


# -- the paths built beside units of several dtypes (mixed_paths_scenarios.py) -------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_a_lora_constraint_in_on_before_zero_grad_is_kept_as_under_ddp(world):
    """Written into gathered copies of units of several dtypes (the root with LoRA on lm_head, gathered from the step's
    start to its backward; every layer under grad_op). Refused before, by the ranks that owned the bytes written only:
    the others went on and died in their next collective (a hang under NCCL)."""
    # (32-true: under bf16-mixed DDP's backward reads the bf16 copies autocast made in forward, from before the write)
    cases = [("full", ("q_proj", "v_proj", "lm_head"), "32-true"), ("grad_op", ("q_proj", "v_proj"), "32-true")]
    for r in run_world(paths.constraint_against_ddp, world, cases, timeout=400)[0]:
        tag = f"{r['case']} on {world} ranks"
        assert r["mixed"], tag  # the writes land in units of several dtypes
        # the same numbers as DDP: losses equal; adapters within an fp32 sum's order (3 ranks; 2: bit for bit)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ddp_losses"]), rtol=1e-6, atol=0,
                                   msg=tag)
        for key, value in r["ddp_adapters"].items():
            torch.testing.assert_close(r["adapters"][key], value, rtol=1e-5, atol=1e-6, msg=f"{tag} {key}")


def test_writes_and_new_tensors_given_to_parameters_of_units_of_several_dtypes_are_kept_like_one_process():
    # keep_gathered(modifier_rank=1) raised on the ranks whose part changed and hung the others in the next unit's
    # broadcast; p.data = ... on shards and clamp_ on gathered copies were refused (by some ranks)
    for param_dtype in (None, torch.bfloat16):  # bf16: the adapters' fp32 masters take what was written in bf16
        for differences in run_world(paths.writes_kept, 2, param_dtype, timeout=300):
            assert max(differences.values()) <= 1e-6, {k: v for k, v in differences.items() if v > 1e-6}


def test_parameters_of_units_of_several_dtypes_frozen_or_unfrozen_between_micro_batches_train_like_one_process():
    """Plain torch keeps and steps the gradient a parameter got before it was frozen; one unfrozen mid-step gets the
    micro-batches it trained in. Before, a unit of several dtypes reduced the gradients of what trained *now*: the
    frozen adapters' earlier gradients were dropped (7e-2 off after 2 steps), and under no_replica_sync or summed in
    fp32 its held gradients no longer fit the smaller (or larger) layout (an error)."""
    cases = [(policy, deferral, change) for policy in ({}, {"param_dtype": torch.bfloat16})
             for deferral in ("all", "") for change in ("freeze", "unfreeze")]
    cases += [({"sharding": "hybrid", "shard_size": 1}, "replicas", change) for change in ("freeze", "unfreeze")]
    for differences in run_world(paths.frozen_between_micro_batches, 2, cases, timeout=400):
        # SGD on the same micro-batches: fp32's last bits (the reference sums two ranks' gradients in another order)
        assert max(differences) <= 1e-6, list(zip(cases, differences))
