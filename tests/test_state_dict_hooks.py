"""Full state dicts go through the model's state-dict hooks, and loading through its load pre-hooks (issue 14,
item 11d): a hook that renames or reshapes keys gets full tensors, exactly as on the plain model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_shard.checkpoint.consolidate import consolidate
from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.full import full_state_dict
from lightning_shard.checkpoint.pretrained import load_pretrained
from lightning_shard.engine.shard_module import shard_module
from tests import state_dict_hook_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(600)


def test_full_state_dict_and_loading_honour_renaming_hooks_on_two_ranks(tmp_path):
    results = run_world(scenarios.full_round_trip, 2, str(tmp_path), timeout=300)
    keys = results[0]["keys"]
    assert "blocks.0.kernel.kernel" in keys and "blocks.1.up.weight_t" in keys and "embedding.table" in keys
    assert "blocks.0.kernel.weight" not in keys and "embed.weight" not in keys
    # consolidating a sharded checkpoint of it gives the same keys and values as full_state_dict
    model = scenarios.HookedNet()
    consolidated = consolidate(tmp_path / "sharded", model=model)["state_dict"]
    assert model.head.weight is model.embed.weight  # the model keeps the checkpoint's tensors, ties and all
    assert list(consolidated) == keys
    for name, value in results[0]["plain"].items():
        torch.testing.assert_close(consolidated[name], value, rtol=0, atol=0)


def _sharded(model: nn.Module) -> nn.Module:
    shard_module(model, sharding="full", units=["Block"])  # no process group: one rank
    return model


def test_a_renaming_load_hook_reads_a_safetensors_file_lazily(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    plain = scenarios.HookedNet()
    state = {k: v for k, v in plain.state_dict().items() if not k.endswith("weight_t") and k != "head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    torch.manual_seed(4)
    model = _sharded(scenarios.HookedNet())
    missing, unexpected = load_pretrained(model, tmp_path / "w.safetensors", strict=False)
    assert sorted(missing) == ["blocks.0.up.weight", "blocks.1.up.weight"] and unexpected == []
    full = full_state_dict(model._shard_runtime)
    for name, value in state.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0)


def test_a_load_hook_computing_values_from_a_lazily_read_file_is_refused_naming_it(tmp_path):
    from safetensors.torch import save_file

    plain = scenarios.HookedNet()
    save_file({k: v.contiguous() for k, v in plain.state_dict().items() if k != "head.weight"},
              str(tmp_path / "w.safetensors"))
    model = _sharded(scenarios.HookedNet())
    with pytest.raises(CheckpointError, match=r"pre-hook '_load_transposed' of module 'blocks\.0\.up'"):
        load_pretrained(model, tmp_path / "w.safetensors")
    torch.save(plain.state_dict(), tmp_path / "w.pt")  # read in full: the hook gets real tensors
    assert load_pretrained(model, tmp_path / "w.pt") == ([], [])
    full = full_state_dict(model._shard_runtime)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0)


class OwnLoader(nn.Linear):
    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_a_module_loading_its_sharded_parameters_itself_is_refused_naming_it():
    model = nn.Sequential(nn.Linear(4, 4), OwnLoader(4, 4))
    state = copy.deepcopy(model.state_dict())
    state["1.w"] = state.pop("1.weight")
    runtime = shard_module(model)
    with pytest.raises(CheckpointError, match=r"'1' \(OwnLoader\) overrides _load_from_state_dict"):
        from lightning_shard.checkpoint.full import load_full_state_dict

        load_full_state_dict(runtime, state)
