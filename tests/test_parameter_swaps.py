"""Inside keep_gathered(), parameters given other tensors or replaced by other Parameter objects: with
``modifier_rank`` the modifier's values become every rank's shards (bit for bit), without it the exit refuses, naming
them; peft's merge_adapter() inside the block, on a bf16 and on a 4-bit base, gives one process's merged logits."""

from __future__ import annotations

import pytest

from tests import parameter_swap_scenarios as s
from tests.mixed_scenarios import write_base
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("kind,how,modifier", [("plain", "rebind", 0), ("mixed", "rebind", 1), ("plain", "replace", 1),
                                               ("mixed", "replace", 0)])
def test_values_given_inside_keep_gathered_are_the_modifiers_on_every_rank(kind, how, modifier):
    """(``p.data = t`` was broadcast before the rebound tensors were taken in: each rank kept its own draws, 3.33 off
    rank 0's; a replaced Parameter was dropped at the exit, the model kept its old values.)"""
    for off in run_world(s.kept_from_the_modifier, 2, kind, how, modifier, timeout=200):
        stepped = off.pop("after a step, relative")
        assert max(off.values()) == 0.0 and stepped <= 1e-6, (off, stepped)


@pytest.mark.parametrize("kind,how", [("plain", "rebind"), ("mixed", "replace")])
def test_values_given_inside_keep_gathered_without_a_modifier_are_refused_naming_them(kind, how):
    """(``p.data = t`` raised nothing, and the values were lost.)"""
    for message in run_world(s.refused_without_a_modifier, 2, kind, how, timeout=200):
        assert "were written inside keep_gathered()" in message and "modifier_rank=0" in message, message


def test_a_replacement_of_another_shape_is_refused_naming_it():
    for message in run_world(s.wrong_shape_refused, 2, timeout=200):
        assert "'1.in_proj.weight' was replaced by a torch.float32 tensor of shape (3, 3)" in message, message


def test_peft_merge_inside_keep_gathered_gives_one_process_merged_logits(tmp_path):
    """(The 4-bit merge's new Params4bit was dropped at the exit: the logits were the base's, 0.77 off.)"""
    write_base(str(tmp_path))
    for off in run_world(s.lora_merged_inside, 2, str(tmp_path), timeout=250):
        assert off["bf16 base"] == 0.0 and off["4-bit base"] == 0.0, off
        assert off["bf16 base: the merge's effect"] > 1e-3 and off["4-bit base: the merge's effect"] > 1e-2, off


def test_a_quantization_state_read_after_keep_gathered_is_an_error_not_a_segfault(tmp_path):
    write_base(str(tmp_path))
    for message in run_world(s.quant_state_kept, 2, str(tmp_path), timeout=200):
        assert "quantization state of 'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight' was read" \
            " after its unit was freed" in message, message
