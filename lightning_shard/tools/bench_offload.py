"""Offload benchmark: an HF Llama trained with and without ``offload``, one process per configuration, world 1.

    python -m lightning_shard.tools.bench_offload --device cuda --model llama-840m --offload none optimizer params
    python -m lightning_shard.tools.bench_offload --device cuda --model llama-5b --offload none params --steps 20
    python -m lightning_shard.tools.bench_offload --model llama-tiny          # a smoke run on the CPU

The model is ``transformers.LlamaForCausalLM`` from a config (built on the meta device, materialised unit by unit
by the strategy; nothing is downloaded), trained with ShardStrategy under bf16-mixed with AdamW on random tokens.
Each configuration runs in a process of its own (the device's peak and the host's high-water mark are its own),
and a configuration that runs out of device memory is reported as such (measured, not assumed). Per
configuration: the median step time after warm-up and its ratio to ``none``, the device's
``max_memory_allocated`` peak, the host's resident peak above the process's start, the master shards' bytes in host
memory (pinned on a GPU), and the first and last losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.tools.bench_probes import HostPeak, PhaseTimer, StepTimer

# (layers, hidden, intermediate, heads, KV heads, vocab, sequence, batch)
MODELS = {
    "llama-tiny": (2, 64, 176, 4, 2, 512, 64, 2),
    "llama-840m": (16, 2048, 5504, 16, 4, 32000, 1024, 4),
    "llama-5b": (36, 3584, 9632, 28, 4, 32000, 1024, 1),
}
OFFLOAD = ("none", "optimizer", "params")
GiB = 2**30
nan = float("nan")


def llama(name: str):
    try:
        import transformers
    except ImportError as err:
        raise SystemExit(f"{name} needs transformers: pip install transformers ({err})") from err
    layers, hidden, inner, heads, kv, vocab, _, _ = MODELS[name]
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                      tie_word_embeddings=False, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(config)


def run_one(name: str, offload: Optional[str], device: str, steps: int, warmup: int) -> dict:
    """One configuration in this process."""
    import lightning as L

    from lightning_shard import ShardStrategy
    from lightning_shard.engine.offload import HostShard
    from lightning_shard.engine.optimizer_step import ShardedStep

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = llama(name)  # on the meta device: the strategy materialises it unit by unit

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.detach())  # read after the run: a read here would wait for each forward
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    *_, vocab, seq, batch = MODELS[name]
    tokens = torch.randint(0, vocab, ((steps + warmup) * batch, seq), generator=torch.Generator().manual_seed(0))
    host = HostPeak()
    host.start()
    timer = StepTimer(cuda=device == "cuda")
    # where an offloaded step's host time goes: the CPU's optimizer step, the bf16 staging casts (with any wait for
    # the previous copy from them), the wait for the gradients' copies to the host
    phases = PhaseTimer({"optimizer": (ShardedStep, "_step"), "staging": (HostShard, "_staged"),
                         "grad_wait": (HostShard, "await_host_grads")})
    torch.manual_seed(0)
    module = LitLlama()
    trainer = L.Trainer(accelerator=device, devices=1, strategy=ShardStrategy(offload=offload),
                        precision="bf16-mixed", max_steps=steps + warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, phases])
    result: dict = {"offload": offload or "none"}
    try:
        trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=batch))
    except torch.cuda.OutOfMemoryError as err:
        result["error"] = f"CUDA out of memory: {str(err).splitlines()[0][:160]}"
    times = timer.times[warmup:]
    result["phases_s"] = {name: statistics.median(step[name] for step in phases.steps[warmup:]) if times else nan
                          for name in phases.current}
    runtime = getattr(trainer.strategy, "runtime", None)
    on_host = sum(u.storage.shard.numel() * u.storage.shard.element_size() for u in runtime.units
                 if u.storage.offloaded) if runtime is not None else 0
    result.update(
        step_s=statistics.median(times) if times else float("nan"), steps=len(times),
        device_peak_gib=torch.cuda.max_memory_allocated() / GiB if device == "cuda" else float("nan"),
        host_peak_gib=host.growth_mb() / 1024, master_on_host_gib=on_host / GiB,
        losses=[float(module.losses[0]), float(module.losses[-1])] if module.losses else [],
    )
    return result


def table(name: str, results: list[dict]) -> str:
    base = next((r["step_s"] for r in results if r["offload"] == "none" and "error" not in r), float("nan"))
    peak = next((r["device_peak_gib"] for r in results if r["offload"] == "none" and "error" not in r), float("nan"))
    rows = [f"{'offload':<11}{'step s':>9}{'x none':>8}{'device peak GiB':>17}{'x none':>8}{'host peak GiB':>15}"
            f"{'master on host GiB':>20}{'optimizer s':>13}{'staging s':>11}{'grad wait s':>13}"
            "  losses (first, last) / error"]
    for r in results:
        losses = r.get("error") or ", ".join(f"{v:.3f}" for v in r["losses"])
        phases = r.get("phases_s") or {}
        rows.append(f"{r['offload']:<11}{r['step_s']:>9.3f}{r['step_s'] / base:>8.2f}{r['device_peak_gib']:>17.2f}"
                    f"{r['device_peak_gib'] / peak:>8.2f}{r['host_peak_gib']:>15.2f}{r['master_on_host_gib']:>20.2f}"
                    f"{phases.get('optimizer', nan):>13.3f}{phases.get('staging', nan):>11.3f}"
                    f"{phases.get('grad_wait', nan):>13.3f}  {losses}")
    layers, hidden, inner, heads, kv, vocab, seq, batch = MODELS[name]
    rows.append(f"\n{name}: LlamaForCausalLM, {layers} layers, hidden {hidden}, intermediate {inner}, {heads} heads /"
                f" {kv} KV, vocab {vocab} (untied), sequence {seq}, batch {batch}; bf16-mixed, AdamW, world 1; one"
                " process per configuration")
    gpu = f"{torch.cuda.get_device_name()}, " if torch.cuda.is_available() else ""
    rows.append(f"machine: {gpu}{os.cpu_count()} cores; torch {torch.__version__}")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.bench_offload", description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=tuple(MODELS), default="llama-tiny")
    parser.add_argument("--offload", nargs="+", choices=OFFLOAD, default=list(OFFLOAD))
    parser.add_argument("--steps", type=at_least(1), default=6)
    parser.add_argument("--warmup", type=at_least(1), default=2)
    parser.add_argument("--one", choices=OFFLOAD, help=argparse.SUPPRESS)  # a child process: one configuration
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.one is not None:  # a child: one configuration
        offload = None if args.one == "none" else args.one
        with open(args.out, "w") as f:
            json.dump(run_one(args.model, offload, args.device, args.steps, args.warmup), f)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for offload in args.offload:
            out = os.path.join(tmp, f"{offload}.json")
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "lightning_shard.tools.bench_offload", "--device",
                                   args.device, "--model", args.model, "--steps", str(args.steps), "--warmup",
                                   str(args.warmup), "--one", offload, "--out", out],
                                  capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode != 0 or not os.path.exists(out):
                print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                results.append({"offload": offload, "error": f"exit {proc.returncode}", "step_s": float("nan"),
                                "device_peak_gib": float("nan"), "host_peak_gib": float("nan"),
                                "master_on_host_gib": float("nan"), "losses": []})
            else:
                with open(out) as f:
                    results.append(json.load(f))
            # the figures at once: a run stopped before the table still says what the finished ones measured
            print(f"{offload} done in {time.perf_counter() - start:.0f} s: {json.dumps(results[-1])}", flush=True)
    print(table(args.model, results))


if __name__ == "__main__":
    main()
