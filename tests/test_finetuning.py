"""Parameter groups added, and parameters frozen, during fit (issue 33): with every kind of optimizer, through
Lightning's fine-tuning callbacks and a resume, on 2 and 3 ranks, against one process on the same global batches.

The models leave shards empty on some ranks, so Lightning's ``BaseFinetuning.filter_on_optimizer`` (a value
comparison) drops different parameters on different ranks: each test asserts that the ranks' groups had to be
merged, and ended the same on every rank."""

from __future__ import annotations

import pytest

from lightning_shard.engine.optim.optimizer_groups import GroupMismatch, GroupView, merge_groups
from tests import finetuning_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("world,names", [(2, ["adamw", "adafactor", "lamb", "muon"]), (3, ["adafactor", "muon"])])
def test_groups_added_by_value_comparison_are_merged_and_train_like_one_process(world, names):
    # on 3 ranks, Adafactor's owners changed when the group was added, leaving its state behind (1.6e-3 off)
    results = run_world(scenarios.merges_then_refusal, world, names, timeout=300)
    reports = [report for report, _ in results]
    for name in names:
        assert [r[name]["groups"] for r in reports] == [reports[0][name]["groups"]] * world, name
        assert reports[0][name]["merged"][0] == 1, name  # the backbone's group, once; AdamW beside Muon: none
        assert len(reports[0][name]["groups"][0]) == (6 if name == "muon" else 9), name
    # a group that rank 1 alone added, whose shards on rank 0 equal nothing there: refused on every rank, named
    for _, refusal in results:
        assert "are in a param group on ranks [1] and in none on rank 0" in refusal
        assert "'backbone.0.0.weight'" in refusal


def test_lightning_fine_tuning_with_every_optimizer_then_resumed_on_other_world_sizes(tmp_path):
    """BackboneFinetuning (unfreeze at epoch 1, block 0 frozen again at epoch 3) over 4 epochs on 2 ranks, saving
    every epoch; then resumed from epoch 1 on 3 ranks (sharded) and on 1 (full); all against one process."""
    # Lightning's own filter (compares identities under the strategy: nothing to merge), or a value comparison as
    # third-party callbacks may do (the ranks' groups merged at the first step after the unfreeze, and the callback's
    # record of them rewritten: the full checkpoint of epoch 1 resumes)
    cases = [("adamw", 1, "sharded", False), ("adafactor", 1, "full", True), ("lamb", 1, None, True),
             ("muon", 1, None, True), ("adamw", 2, None, True)]
    results = run_world(scenarios.lightning_finetuning, 2, cases, str(tmp_path), timeout=500)
    for i, (name, _, _, by_value) in enumerate(cases):
        first = results[0][i]
        assert all(r[i] == first for r in results), name  # the same groups on every rank
        assert first["merged"] == int(by_value), name
        assert first["groups"] == ([[2, 4], [1]] if name == "muon" else [[3, 6]]), name
        assert not any(n.startswith("net.backbone.0.") for n in first["trainable"]), name  # frozen again
    assert run_world(scenarios.lightning_resume, 3, [("adamw", "sharded", False)], str(tmp_path), timeout=300) == [
        [{"groups": [[3, 6]]}]] * 3
    assert run_world(scenarios.lightning_resume, 1, [("adafactor", "full", True)], str(tmp_path), timeout=300) == [
        [{"groups": [[3, 6]]}]]


def test_merging_takes_the_union_of_what_value_comparisons_dropped():
    head = {"lr": 0.1, "betas": (0.9, 0.99)}
    backbone = {"lr": 0.01, "betas": (0.9, 0.99)}
    views = [
        [GroupView(head, ["h.w", "h.b"]), GroupView(backbone, ["b.w"])],  # rank 0 dropped b.b
        [GroupView(head, ["h.w", "h.b"])],  # rank 1 dropped the whole backbone group
        [GroupView(head, ["h.w", "h.b"]), GroupView(backbone, ["b.w", "b.b"])],
    ]
    merged = merge_groups(views, "AdamW")
    assert [(m.names, sorted(m.ranks)) for m in merged] == [(["h.w", "h.b"], [0, 1, 2]),
                                                            (["b.w", "b.b"], [0, 2])]
    assert merged[1].options == backbone


@pytest.mark.parametrize("second,message", [
    ([GroupView({"lr": 0.1}, ["h.w", "b.w"])], "hold 'h.w' and 'b.w' in one param group on rank 1"),
    ([GroupView({"lr": 0.1}, ["h.w"]), GroupView({"lr": 0.02}, ["b.w"])], "lr=0.02 on rank 1 and 0.01 on rank 0"),
    ([GroupView({"lr": 0.01}, ["b.w"]), GroupView({"lr": 0.1}, ["h.w"])], "in different orders"),
])
def test_real_differences_between_ranks_groups_are_refused(second, message):
    first = [GroupView({"lr": 0.1}, ["h.w"]), GroupView({"lr": 0.01}, ["b.w"])]
    with pytest.raises(GroupMismatch, match=message.replace("(", r"\(").replace("[", r"\[")):
        merge_groups([first, second], "AdamW")
