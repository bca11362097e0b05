"""Offload benchmark: an HF Llama trained with and without ``offload``, one process per configuration, world 1.

    python -m lightning_shard.tools.bench_offload --device cuda --model llama-840m \
        --offload none optimizer optimizer-serial params none:16 optimizer:16
    python -m lightning_shard.tools.bench_offload --device cuda --model llama-5b --offload none optimizer --steps 4
    python -m lightning_shard.tools.bench_offload --model llama-tiny          # a smoke run on the CPU

The model is ``transformers.LlamaForCausalLM`` from a config (built on the meta device, materialised unit by unit
by the strategy; nothing is downloaded), trained with ShardStrategy under bf16-mixed with AdamW on random tokens.
A configuration is ``none``, ``optimizer`` or ``params`` (the optimizer step overlapped with backward, as the
strategy does by default), ``optimizer-serial`` or ``params-serial`` (``offload_overlap=False``: the CPU's step after
the backward, whose optimizer phase is the CPU's pass alone), each with an optional ``:BATCH`` and an optional
``@THREADS`` (the host step's CPU threads, ``LIGHTNING_SHARD_HOST_STEP_THREADS``; 0: every core). Each runs in a
process of its own, forked from one that imported everything once (the device's peak and the host's high-water mark
are its own), and one that runs out of device memory is reported as such (measured, not assumed). Per
configuration: the median step after warm-up and its ratio to ``none`` at the same batch, the device's
``max_memory_allocated`` peak, the host's resident peak above the process's start, the master shards' bytes in host
memory (pinned on a GPU), the host's time per step in the optimizer's step (serial: the CPU's pass; overlapped: the
wait for it), in the overlapped step's worker, waiting for gradients, the speculative steps' backups at their
peak, the units per step the worker stepped after ``optimizer.step()`` returned (the next forward ran behind it);
the first and last losses.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time

import torch

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.tools import spawn_ranks
from lightning_shard.tools.bench_probes import HostPeak, PhaseTimer, StepTimer

# (layers, hidden, intermediate, heads, KV heads, vocab, sequence, batch)
MODELS = {
    "llama-tiny": (2, 64, 176, 4, 2, 512, 64, 2),
    "llama-840m": (16, 2048, 5504, 16, 4, 32000, 1024, 4),
    "llama-5b": (36, 3584, 9632, 28, 4, 32000, 1024, 1),
}
OFFLOAD = ("none", "optimizer", "params", "optimizer-serial", "params-serial")
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


def run_one(name: str, config: str, device: str, steps: int, warmup: int) -> dict:
    """One configuration (``OFFLOAD[:batch]``) in this process."""
    import lightning as L

    from lightning_shard import ShardStrategy
    from lightning_shard.engine.optim.host_step import HostStepper
    from lightning_shard.engine.optim.optimizer_step import ShardedStep
    from lightning_shard.engine.storage.offload import HostMaster

    config_only, _, threads = config.partition("@")
    if threads:
        os.environ["LIGHTNING_SHARD_HOST_STEP_THREADS"] = threads  # (this configuration's process only)
    mode, _, batch_text = config_only.partition(":")
    offload = None if mode == "none" else mode.removesuffix("-serial")

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
    batch = int(batch_text) if batch_text else batch
    tokens = torch.randint(0, vocab, ((steps + warmup) * batch, seq), generator=torch.Generator().manual_seed(0))
    host = HostPeak()
    host.start()
    timer = StepTimer(cuda=device == "cuda")
    # where an offloaded step's host time goes: the optimizer's step (serial: the CPU's pass; overlapped: the wait
    # for the worker), the overlapped step's worker stepping units, the bf16 staging casts (with any wait for the
    # previous copy from them), the wait for the gradients' copies to the host (the worker's too)
    phases = PhaseTimer({"optimizer": (ShardedStep, "_step"), "worker": (HostStepper, "_step_unit"),
                         "staging": (HostMaster, "_staged"), "grad_wait": (HostMaster, "await_host_grads")})
    torch.manual_seed(0)
    module = LitLlama()
    strategy = ShardStrategy(offload=offload, offload_overlap=not mode.endswith("-serial"))
    trainer = L.Trainer(accelerator=device, devices=1, strategy=strategy,
                        precision="bf16-mixed", max_steps=steps + warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, phases])
    result: dict = {"offload": config, "mode": mode, "batch": batch}
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
    stepper = getattr(runtime, "host_stepper", None)
    result.update(
        step_s=statistics.median(times) if times else float("nan"), steps=len(times),
        device_peak_gib=torch.cuda.max_memory_allocated() / GiB if device == "cuda" else float("nan"),
        host_peak_gib=host.growth_mb() / 1024, master_on_host_gib=on_host / GiB,
        overlapped=stepper.overlapped_steps if stepper is not None else 0,
        backups_gib=stepper.peak_backup_bytes / GiB if stepper is not None else 0.0,
        behind=stepper.deferred.deferred_units / max(stepper.overlapped_steps, 1) if stepper is not None else 0.0,
        losses=[float(module.losses[0]), float(module.losses[-1])] if module.losses else [],
    )
    return result


def table(name: str, results: list[dict]) -> str:
    def base(r: dict, key: str) -> float:
        return next((b[key] for b in results if b.get("mode") == "none" and b.get("batch") == r.get("batch")
                     and "error" not in b), nan)

    def cpu_pass(r: dict) -> float:  # the serial run's optimizer phase at the same batch and offload mode
        serial = f"{r.get('mode', '').removesuffix('-serial')}-serial"
        return next((b["phases_s"]["optimizer"] for b in results if b.get("mode") == serial
                     and b.get("batch") == r.get("batch") and "error" not in b), nan)

    rows = [f"{'offload':<20}{'step s':>8}{'x none':>8}{'x limit':>8}{'device GiB':>11}{'x none':>7}{'host GiB':>9}"
            f"{'master GiB':>11}{'optimizer s':>12}{'worker s':>9}{'staging s':>10}{'grad wait s':>12}"
            f"{'backups GiB':>12}{'behind':>7}  losses (first, last) / error"]
    for r in results:
        losses = r.get("error") or ", ".join(f"{v:.3f}" for v in r["losses"])
        phases = r.get("phases_s") or {}
        limit = max(base(r, "step_s"), cpu_pass(r))  # the exact offloaded step's floor (issue 50)
        rows.append(f"{r['offload']:<20}{r['step_s']:>8.3f}{r['step_s'] / base(r, 'step_s'):>8.2f}"
                    f"{r['step_s'] / limit:>8.2f}{r['device_peak_gib']:>11.2f}"
                    f"{r['device_peak_gib'] / base(r, 'device_peak_gib'):>7.2f}{r['host_peak_gib']:>9.2f}"
                    f"{r['master_on_host_gib']:>11.2f}{phases.get('optimizer', nan):>12.3f}"
                    f"{phases.get('worker', nan):>9.3f}{phases.get('staging', nan):>10.3f}"
                    f"{phases.get('grad_wait', nan):>12.3f}{r.get('backups_gib', nan):>12.2f}"
                    f"{r.get('behind', nan):>7.1f}  {losses}")
    layers, hidden, inner, heads, kv, vocab, seq, batch = MODELS[name]
    rows.append(f"\n{name}: LlamaForCausalLM, {layers} layers, hidden {hidden}, intermediate {inner}, {heads} heads /"
                f" {kv} KV, vocab {vocab} (untied), sequence {seq}, batch {batch} unless :BATCH; bf16-mixed, AdamW,"
                " world 1; one process per configuration. x limit: the step over the larger of the step without"
                " offload and the CPU's optimizer pass alone (the serial run's optimizer s) at the same batch; behind:"
                " units per step stepped after optimizer.step() returned, the next forward waiting for each")
    gpu = f"{torch.cuda.get_device_name()}, " if torch.cuda.is_available() else ""
    rows.append(f"machine: {gpu}{os.cpu_count()} cores; torch {torch.__version__}")
    return "\n".join(rows)


def _child(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    """One configuration, in a process of its own."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["PYTHONWARNINGS"] = "ignore"
    result = run_one(args.model, args.one, args.device, args.steps, args.warmup)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(result, f)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.bench_offload", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=tuple(MODELS), default="llama-tiny")
    parser.add_argument("--offload", nargs="+", type=_config, default=["none", "optimizer", "params"],
                        help=f"configurations: {', '.join(OFFLOAD)}, each with an optional :BATCH and @THREADS"
                             " (default: none optimizer params)")
    parser.add_argument("--steps", type=at_least(1), default=6)
    parser.add_argument("--warmup", type=at_least(1), default=2)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    results = []
    for config in args.offload:
        start = time.perf_counter()
        try:
            results.append(spawn_ranks(_child, 1, argparse.Namespace(**vars(args), one=config))[0])
        except RuntimeError as err:
            print(str(err)[-4000:], flush=True)
            mode, _, batch = config.partition(":")
            results.append({"offload": config, "mode": mode, "batch": int(batch) if batch else MODELS[args.model][-1],
                            "error": "failed", "step_s": nan, "device_peak_gib": nan, "host_peak_gib": nan,
                            "master_on_host_gib": nan, "losses": []})
        # the figures at once: a run stopped before the table still says what the finished ones measured
        shown = {k: v for k, v in results[-1].items() if k != "losses"}
        print(f"{config} done in {time.perf_counter() - start:.0f} s: {json.dumps(shown)}", flush=True)
    print(table(args.model, results))


def _config(text: str) -> str:
    config, at, threads = text.partition("@")
    mode, colon, batch = config.partition(":")
    if (mode not in OFFLOAD or (colon and not (batch.isdigit() and int(batch) > 0))
            or (at and not threads.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(OFFLOAD)}, with an optional :BATCH (a positive"
                                         " integer) and an optional @THREADS (a whole number, 0: every core)")
    return text


if __name__ == "__main__":
    main()
