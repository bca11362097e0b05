"""Mixture-of-experts folders: transformers 5 holds the routed experts fused in memory (one 3-D tensor per layer)
and one tensor per expert in the files. A hub folder loads into a sharded model, each rank reading its slices, and
exports (from the live model and from a checkpoint) write the files' layout, as the model's own save_pretrained."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from lightning_shard.checkpoint.export_checkpoint import export_checkpoint
from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.pretrained import load_pretrained
from tests import moe_folder_scenarios as scenarios
from tests.world import run_world

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="fused experts: transformers 5")]


@pytest.mark.parametrize("kind,world", [("mixtral", 2), ("qwen3_moe", 3)])
def test_an_moe_folder_loads_by_slices_and_exports_as_transformers_writes_it(tmp_path, kind, world):
    folder = tmp_path / "hub"
    scenarios.write_folder(kind, str(folder))
    written = scenarios.tensors(folder)
    assert len(list(folder.glob("model-*.safetensors"))) > 2 and any(".experts.0." in k for k in written)
    report = run_world(scenarios.round_trip, world, kind, str(folder), str(tmp_path / "out"), timeout=500)[0]
    assert report["loaded_keys"] == ([], [])
    assert report["loaded"] <= 1e-6  # every expert in its place: from_pretrained's logits
    assert report["same_names"] and report["largest_difference"] == 0.0  # the hub's files, bit for bit
    assert report["trained_names"] and report["trained"] <= 1e-6, report
    assert report["merged_names"] and report["merged"] <= 1e-5, report


def test_a_folder_whose_experts_are_fused_on_disk_too_loads_and_exports_as_it_is(tmp_path):
    """Qwen3-VL-MoE: transformers 5 writes its experts fused, and converts them with a transpose only where their
    shapes differ from the model's; the export must compare with full shapes, not the 1-D shards (a square
    ``down_proj`` was written transposed)."""
    folder = tmp_path / "hub"
    scenarios.write_folder("qwen3_vl_moe", str(folder))
    assert run_world(scenarios.load_and_export, 2, "qwen3_vl_moe", str(folder), str(tmp_path / "out"),
                     timeout=300) == [([], [])] * 2
    original, exported = scenarios.tensors(folder), scenarios.tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original) and all(torch.equal(original[k], exported[k]) for k in original)


@pytest.mark.parametrize("unit_size", [None, 1500])
def test_lora_on_the_fused_experts_trains_like_one_process_and_exports_its_adapter(tmp_path, unit_size):
    folder = tmp_path / "hub"
    scenarios.write_folder("mixtral", str(folder))
    report = run_world(scenarios.lora_on_experts, 2, str(folder), str(tmp_path / "out"), unit_size, timeout=300)[0]
    assert report["loaded_keys"] == ([], [])  # the base's per-expert files into the wrapped fused experts
    assert report["against_one_process"] <= 1e-6 and report["adapter"] <= 1e-6, report
    assert report["merged"] <= 1e-6 and report["merged_names"], report


def test_the_experts_class_under_lora_on_the_experts_names_their_wrapper():
    """peft's ``target_parameters`` wraps the experts: ``units=[MixtralExperts]`` makes each wrapper a unit (nothing
    was, silently: the whole model in the root unit), and checkpointing the experts alone is refused (recomputed
    outside their wrapper, they would compute without the adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from lightning_shard.engine.plan.plan import plan_units
    from lightning_shard.engine.runtime.activation_checkpointing import checkpoint_targets

    model = get_peft_model(scenarios.model_class("mixtral")(scenarios.config("mixtral")), LoraConfig(
        r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    experts = [f"base_model.model.model.layers.{i}.mlp.experts" for i in range(2)]
    assert [p.name for p in plan_units(model, units=[MixtralExperts])] == [*experts, "<root>"]
    with pytest.raises(ValueError, match=f"lies inside peft's '{experts[0]}', which adapts its parameter"):
        checkpoint_targets(model, [], (MixtralExperts,))


def test_an_adapter_trained_on_transformers_4s_per_expert_layers_is_refused_with_what_to_do(tmp_path):
    """peft converts such an adapter (``target_modules=["w1", "w2", "w3"]``) as it loads it; load_pretrained cannot."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    (tmp_path / "adapter").mkdir()
    LoraConfig(r=2, target_modules=["w1", "w2", "w3"]).save_pretrained(tmp_path / "adapter")
    name = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1.lora_A.weight"
    save_file({name: torch.zeros(2, 16)}, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(scenarios.model_class("mixtral")(scenarios.config("mixtral")),
                               LoraConfig.from_pretrained(tmp_path / "adapter"))  # converted by peft
    with pytest.raises(CheckpointError, match="transformers 4's per-expert layers.*PeftModel.from_pretrained"):
        load_pretrained(model, tmp_path / "adapter")


def test_unsharded_loads_and_checkpoint_exports_convert_too(tmp_path):
    folder = tmp_path / "hub"
    scenarios.write_folder("mixtral", str(folder))
    torch.manual_seed(1)
    model = scenarios.model_class("mixtral")(scenarios.config("mixtral"))
    assert load_pretrained(model, folder) == ([], [])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    # a checkpoint holds the names the model has in memory; its export, the files' names
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "plain.ckpt")
    export_checkpoint(tmp_path / "plain.ckpt", tmp_path / "exported", model_config=folder)
    original, exported = scenarios.tensors(folder), scenarios.tensors(tmp_path / "exported")
    assert sorted(exported) == sorted(original) and all(torch.equal(original[k], exported[k]) for k in original)
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]


def test_a_folder_missing_an_expert_is_named(tmp_path):
    folder = tmp_path / "hub"
    scenarios.write_folder("mixtral", str(folder))
    shutil.move(folder, tmp_path / "split")
    folder.mkdir()
    kept = {k: v for k, v in scenarios.tensors(tmp_path / "split").items() if "layers.1.block_sparse_moe.experts.2.w3" not in k}
    from safetensors.torch import save_file

    save_file(kept, str(folder / "model.safetensors"))
    shutil.copy(tmp_path / "split" / "config.json", folder / "config.json")
    error = run_world(scenarios.missing_expert, 2, str(folder), timeout=300)[0]
    assert error.startswith("CheckpointError: load_pretrained: 'model.layers.1.mlp.experts.gate_up_proj' is made of 4"
                            " experts") and "expert 2's '.experts.*.w3.weight'" in error, error
