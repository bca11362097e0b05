"""Fine-tuning the way Hugging Face users work (issue 32): an HF folder in, a few sharded steps, a folder
``from_pretrained`` loads out, for full fine-tuning and for peft LoRA; LoRA checkpoints that hold the adapter alone,
resume exactly and refuse another base; the export command from a checkpoint on disk."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from lightning_shard.checkpoint.files import CheckpointError
from lightning_shard.checkpoint.pretrained import load_pretrained
from lightning_shard.checkpoint.sharded import read_metadata
from tests import pretrained_scenarios as scenarios
from tests.world import run_world

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "base"
    scenarios.write_base(str(folder))
    assert len(list(folder.glob("model-*.safetensors"))) > 3  # an index and several shards, as big models come
    return folder


@pytest.mark.parametrize("world", [2, 3])
def test_an_hf_folder_in_sharded_training_and_folders_from_pretrained_loads_out(base, tmp_path, world):
    report = run_world(scenarios.round_trip, world, str(base), str(tmp_path), timeout=500)[0]
    # the loaded sharded model, the full export, the adapter export (PeftModel.from_pretrained), the adapter loaded
    # back into unsharded and sharded peft models, the merged export: logits within 1e-6 of the sharded model's
    for key in ("loaded", "full", "adapter", "adapter_loaded", "adapter_resharded", "merged"):
        assert report[key] <= 1e-6, (key, report[key])
    assert "model.safetensors.index.json" in report["full_files"] and "config.json" in report["full_files"]
    # as transformers' save_pretrained writes it: the class (which serving tools read) and the files' dtype
    assert report["full_config"]["architectures"] == ["LlamaForCausalLM"]
    assert report["full_config"]["dtype"] == "float32"
    assert report["adapter_files"] == ["adapter_config.json", "adapter_model.safetensors"]


def test_folders_that_do_not_fit_are_named(base, tmp_path):
    from transformers import AutoModelForCausalLM

    scenarios.lora(AutoModelForCausalLM.from_pretrained(base)).save_pretrained(tmp_path / "adapter")
    errors = run_world(scenarios.wrong_folders, 2, str(base), str(tmp_path / "adapter"), timeout=300)[0]
    assert errors[0].startswith("fewer layers: CheckpointError: The weights do not fit the model") and \
        "unexpected ['model.layers.1." in errors[0]
    assert "is a peft adapter folder; it goes into a peft model" in errors[1]
    assert "holds no weights: a Hugging Face model folder has one of" in errors[2]
    with pytest.raises(CheckpointError, match="has no parameters yet"):  # called before configure_model built it
        load_pretrained(torch.nn.Module(), base)


def test_a_base_models_folder_fills_the_base_of_a_task_model_and_leaves_its_head(tmp_path):
    from transformers import LlamaModel

    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaModel(scenarios.llama_config(tied=False)).save_pretrained(tmp_path / "base_model")
    reports = run_world(scenarios.base_folder_into_a_task_model, 2, str(tmp_path / "base_model"), timeout=300)
    assert all(r["loaded"] == ([], []) and r["base"] and r["head"] for r in reports), reports
    assert len(reports[0]["warned"]) == 1 and "['model.lm_head.weight'] keep their initial values" in reports[0]["warned"][0]
    assert reports[1]["warned"] == []  # rank 0 says it


def test_a_lora_run_checkpoints_the_adapter_alone_resumes_exactly_and_refuses_another_base(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first = run_world(scenarios.lora_fit, 2, str(base), str(tmp_path), False, timeout=500)[0]
    assert first["start_b"] == 0  # built on the meta device, the adapter starts as peft starts it: B = 0
    checkpoint = tmp_path / "first" / "checkpoints" / "epoch=1.ckpt"
    saved = [k for k in read_metadata(checkpoint).state_dict_metadata if k.startswith(("state_dict.", "optimizer_"))]
    assert saved and all("lora_" in k for k in saved), saved  # the adapter and its optimizer state, no base
    # resumed on 3 ranks from epoch 1: the same adapter as the run that never stopped
    resumed = run_world(scenarios.lora_fit, 3, str(base), str(tmp_path), True, timeout=500)[0]
    assert first["adapter"].keys() == resumed["adapter"].keys()
    for name, value in first["adapter"].items():
        torch.testing.assert_close(resumed["adapter"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the folder SavePretrained wrote at the end of fit loads onto the base with peft, logits as the sharded model's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "first" / "adapter")
    assert (scenarios._logits(reloaded) - first["logits"]).abs().max() <= 1e-6
    # onto another base: refused on every rank, naming the cause
    scenarios.write_base(str(tmp_path / "other"), seed=1)
    errors = run_world(scenarios.lora_resume_on_another_base, 2, str(tmp_path / "other"), str(tmp_path), timeout=300)
    assert all("was saved without its frozen parameters (ShardStrategy(save_frozen=False))" in e for e in errors), errors
    # the export command: the last checkpoint's adapter, a folder peft loads (from the checkpoint's own record)
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "lightning_shard.export",
                           str(tmp_path / "first" / "checkpoints" / "epoch=3.ckpt"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    assert (scenarios._logits(exported) - first["logits"]).abs().max() <= 1e-6


def test_the_export_command_finds_the_model_in_another_strategys_checkpoint(base, tmp_path):
    """A plain Lightning checkpoint file (keys under ``model.``, tied head included), exported with --model-config:
    the prefix found, the tied copy left out, config.json written, files of at most --max-shard-size."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "epoch": 3},
               tmp_path / "plain.ckpt")
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "lightning_shard.export", str(tmp_path / "plain.ckpt"), str(out),
                           "--model-config", str(base / "config.json"), "--max-shard-size", "30KB",
                           "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    assert all(p.stat().st_size <= 30_000 + 2_000 for p in out.glob("model-*.safetensors"))  # and the header
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # the files', not the base's
    assert f"load it: transformers.LlamaForCausalLM.from_pretrained('{out}')" in done.stdout
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    expected = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    assert all(torch.equal(v, expected[k]) for k, v in reloaded.state_dict().items())
    bad = subprocess.run([sys.executable, "-m", "lightning_shard.export", str(tmp_path / "plain.ckpt"), str(out),
                          "--max-shard-size", "lots"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "`max_shard_size` must be a number of bytes or a size" in bad.stderr


def test_a_classifier_lora_two_ties_and_other_adapter_settings(base, tmp_path):
    report = run_world(scenarios.edges, 2, str(base), str(tmp_path), timeout=500)
    assert report[0]["cls adapter"] <= 1e-6 and report[0]["cls merged"] <= 1e-5, report[0]  # the trained head too
    for r in report:  # refused on every rank, before anything was exchanged
        assert "would merge the adapter of 'base_model.model.lm_head' into a weight tied" in r["merge into a tie"]
        assert "was trained with other settings than the model's: lora_alpha: folder 8, model 32" in r["other lora_alpha"]


def test_a_base_folder_fills_the_copies_of_modules_peft_saves_whole(tmp_path):
    scenarios.write_base(str(tmp_path / "untied"), tied=False)
    assert max(run_world(scenarios.copies_from_a_base, 2, str(tmp_path / "untied"), timeout=300)) <= 1e-6


def test_export_folders_keep_what_lies_beside_the_weights_and_refuse_the_rest(tmp_path):
    from torch import nn

    from lightning_shard import save_pretrained

    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "model.safetensors").write_text("an earlier export")
    save_pretrained(nn.Linear(3, 2), out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json"]
    (out / "data").mkdir()
    with pytest.raises(ValueError, match=r"holds \['data'\], which a model folder does not"):
        save_pretrained(nn.Linear(3, 2), out)
    assert (out / "tokenizer.json").exists() and (out / "data").is_dir()


def test_ties_load_through_one_name_and_differing_values_are_refused(base, tmp_path):
    from transformers import LlamaForCausalLM

    from lightning_shard import load_pretrained
    from lightning_shard.checkpoint.files import CheckpointError

    assert load_pretrained(LlamaForCausalLM(scenarios.llama_config(tied=True)), base) == ([], [])  # no lm_head
    scenarios.write_base(str(tmp_path / "untied"), tied=False)
    with pytest.raises(CheckpointError, match="ties 'model.embed_tokens.weight' and 'lm_head.weight', and the files"):
        load_pretrained(LlamaForCausalLM(scenarios.llama_config(tied=True)), tmp_path / "untied")


def test_a_module_holding_two_models_checkpoints_and_loads_by_prefix(base):
    from torch import nn
    from transformers import LlamaForCausalLM

    from lightning_shard import load_pretrained
    from lightning_shard.checkpoint.export_checkpoint import describe_pretrained
    from lightning_shard.checkpoint.files import CheckpointError

    class Distillation(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = LlamaForCausalLM(scenarios.llama_config())
            self.student = LlamaForCausalLM(scenarios.llama_config())

    module = Distillation()
    assert describe_pretrained(module) is None  # no record: the export command asks for --prefix
    with pytest.raises(CheckpointError, match=r"fits the models at \['teacher', 'student'\] alike: pass `prefix=`"):
        load_pretrained(module, base)
    assert load_pretrained(module, base, prefix="student.") == ([], [])


@pytest.mark.parametrize("sharding", ["full", "grad_op"])
def test_the_model_inside_a_sharded_module_loads_and_saves_as_users_pass_it(base, tmp_path, sharding):
    """`load_pretrained(self.model, folder)`: it loaded whole tensors into 1-D shards (torch's size mismatch for every
    weight); `save_pretrained(self.model, folder)` wrote rank 0's 1-D shards as the weights. The root's runtime is
    found, and the model's prefix in it."""
    report = run_world(scenarios.into_a_submodule, 2, str(base), str(tmp_path / "out"), sharding, timeout=300)[0]
    assert report == {"loaded": ([], []), "load": 0.0, "save": 0.0}, report


PLAIN_EXPORT = """
import sys
import torch
from lightning_shard import save_pretrained
save_pretrained(torch.nn.Sequential(torch.nn.Linear(3, 2)), sys.argv[1] + "/plain")
print("peft imported" if "peft" in sys.modules else "peft not imported")
"""


def test_a_plain_model_exports_without_peft_and_missing_packages_are_named(tmp_path):
    from lightning_shard.checkpoint.hf import require

    done = subprocess.run([sys.executable, "-c", PLAIN_EXPORT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["model.safetensors"]
    assert done.stdout.strip().endswith("peft not imported")
    with pytest.raises(ImportError, match="exporting with --model-config needs `not_a_package`: pip install"):
        require("not_a_package", "exporting with --model-config")
