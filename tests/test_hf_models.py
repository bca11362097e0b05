"""Checkpointing the runtime cannot see (issue 14, item 2): a unit member that recomputes its forward in
backward inside the unit's hooks (HF ``gradient_checkpointing_enable()``, or ``torch.utils.checkpoint`` in a
member's own forward) trains exactly like one process on the global batch, with backward gather elision
off (the default) and on."""

from __future__ import annotations

import pytest

from tests import hf_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)

ELIDE = (False, True)


def test_hf_llama_gradient_checkpointing_matches_one_process():
    pytest.importorskip("transformers")
    # None: HF's default (use_reentrant=False since transformers 4.35's rework; True before)
    kwargs = (None, {"use_reentrant": False}, {"use_reentrant": True})
    cases = [(k, elide) for elide in ELIDE for k in kwargs]
    results = run_world(scenarios.run_cases, 2, "llama", cases, timeout=500)
    for rank_results in results:
        assert [r["case"] for r in rank_results] == [
            f"llama, gradient_checkpointing_kwargs={k}, elide={elide}" for k, elide in cases]
        # every decoder layer is read again by the recomputation: no backward gather may be skipped
        assert [r["skipped_gathers"] for r in rank_results] == [0] * len(cases)


def test_torch_checkpoint_inside_a_unit_member_matches_one_process():
    cases = [(reentrant, elide) for elide in ELIDE for reentrant in (False, True)]
    results = run_world(scenarios.run_cases, 2, "torch", cases, timeout=500)
    steps = 3
    for rank_results in results:
        assert len(rank_results) == len(cases)
        for (reentrant, elide), result in zip(cases, rank_results):
            # with elision on, only the embedding unit (fed token ids, it saves no weight) skips its backward
            # gather, once per step; the blocks, recomputed in backward, are all gathered
            assert result["skipped_gathers"] == (steps if elide else 0), result


def test_activation_checkpointing_of_hf_layers_called_with_their_cache_on_matches_one_process():
    """HF models as users call them (``use_cache`` left on): ``activation_checkpointing=True`` recomputes each layer in
    backward, which wrote the layer's keys into the model's cache a second time (Llama with a padded mask: a size
    mismatch; T5: "a different number of tensors was saved"). The layers now run without the empty cache."""
    pytest.importorskip("transformers")
    results = run_world(scenarios.run_cases, 2, "cached", ["llama", "t5"], timeout=500)
    for rank_results in results:
        assert [r["case"] for r in rank_results] == ["llama", "t5", "a cache holding keys"]
        assert "given a `past_key_values` holding keys" in rank_results[-1]["error"] or \
            "given a `cache` holding keys" in rank_results[-1]["error"], rank_results[-1]

