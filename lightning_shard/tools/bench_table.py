"""The benchmark's report: rank 0's results merged with the other ranks' memory peaks, and one table per
precision and optimizer (``lightning_shard.tools.bench``)."""

from __future__ import annotations

import os
import platform
import statistics

import lightning as L
import torch

COMPILED = "_compiled"  # a config's twin with each block compiled (torch.compile per block, as torchtitan does)


def merge_ranks(ranks: list[dict]) -> dict:
    """Rank 0's results, with each run's peak memory the largest over the ranks."""
    merged = ranks[0]
    for table, configs in merged["results"].items():  # table: (precision, optimizer)
        for name, runs in configs.items():
            for i, run in enumerate(runs):
                for key in ("peak_mb", "base_mb", "host_mb"):
                    if key in run:
                        run[key] = max(r["results"][table][name][i][key] for r in ranks)
    return merged


def format_table(results: dict, args, params: int, precision: str, estimates: dict, optimizer: str = "adamw") -> str:
    cuda = args.device == "cuda"
    rows = []
    medians = {name: statistics.median([t for r in runs for t in r["times"]]) for name, runs in results.items()}
    anchors = [(label, medians[name]) for name, label in (
        ("alone", "x alone"), ("fsdp2", "x FSDP2"), ("ddp", "x DDP"), ("plain", "x plain"),
        ("fsdp2" + COMPILED, "x FSDP2-c"), ("ddp" + COMPILED, "x DDP-c")) if name in medians]
    header = f"{'strategy':<23}{'median step s':>14}" + "".join(f"{label:>11}" for label, _ in anchors)
    header += f"{'gathered MB':>13}{'reduced MB':>12}{'cross-group MB':>16}{'collectives':>12}{'exposed comm s':>16}{'state MB/rank':>15}"
    if cuda:
        header += f"{'peak MB/rank':>14}{'est MB':>9}{'est+act MB':>12}"
    header += f"{'host MB/rank':>14}{'est host MB':>13}"
    rows.append(header)
    rows.append("-" * len(header))
    for name, runs in results.items():
        comm = runs[-1]["comm"]
        exposed = [e for r in runs for e in r["exposed"]]
        reduced = comm.get("reduce_scatter_bytes", 0) + comm.get("all_reduce_bytes", 0) + comm.get("cross_group_bytes", 0)
        row = f"{name:<23}{medians[name]:>14.3f}" + "".join(f"{medians[name] / anchor:>11.2f}" for _, anchor in anchors)
        row += (
            f"{(comm['all_gather_bytes'] / 2**20 if comm else float('nan')):>13.1f}"
            f"{(reduced / 2**20 if comm else float('nan')):>12.1f}"
            f"{(comm['cross_group_bytes'] / 2**20 if comm else float('nan')):>16.1f}"
            f"{(comm['collectives'] if comm else float('nan')):>12.0f}"
            f"{(statistics.median(exposed) if exposed and comm else float('nan')):>16.3f}"
            f"{runs[-1]['state_mb']:>15.1f}"
        )
        if cuda:
            row += (f"{max(r['peak_mb'] for r in runs):>14.1f}{runs[-1]['estimate_mb']:>9.1f}"
                    f"{estimates.get((precision, name), float('nan')):>12.1f}")
        row += f"{max(r['host_mb'] for r in runs):>14.1f}{runs[-1]['host_estimate_mb']:>13.1f}"
        rows.append(row)
    if "plain" in medians and "shard_full" in medians:
        ratio = medians["shard_full"] / medians["plain"]
        rows.append(f"\nshard_full / plain: {ratio:.3f} (issue 16's target: <= 1.03) {'met' if ratio <= 1.03 else 'NOT met'}")
    rows.append(f"\nprecision {precision}, optimizer {optimizer}; model: {args.model}, {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MB fp32),"
                f" depth {args.depth}, width {args.width}, seq {args.seq}, batch {args.batch}/rank, vocab {args.vocab}")
    ranks = f"{args.world} {'CUDA' if cuda else 'gloo'} rank{'s' if args.world > 1 else ''}"
    timing = f"{args.rounds} round{'s' if args.rounds > 1 else ''} x {args.steps} timed steps after {args.warmup} warm-up"
    if cuda:
        rows.append(f"{ranks} (NCCL), one GPU each; {timing}, synchronized at each step's start and end;"
                    " comm figures are per optimizer step (nan: not measured)")
        held = max((r["base_mb"] for runs in results.values() for r in runs), default=0.0)
        rows.append("peak MB/rank: torch.cuda.max_memory_allocated() over a run, the largest rank's (what earlier runs"
                    f" still held at a run's start, at most {held:.1f} MB, subtracted)")
        rows.append("est MB: the strategy's own estimate at setup (trainer.strategy.memory_estimate.peak: shards,"
                    " optimizer state, gathered units, gradients; no activations); est+act MB: the same with one"
                    " batch's activations (as python -m lightning_shard.estimate)")
        rows.append("the estimates leave out the CUDA context and NCCL's buffers, as max_memory_allocated does (and the"
                    " caching allocator's reserve): nvidia-smi shows more")
    else:
        rows.append(f"{ranks}, 1 thread each; {timing}; comm figures are per optimizer step (nan: not measured)")
    rows.append("host MB/rank: the process's resident memory at its peak over a run above its start, the largest"
                " rank's (the kernel's high-water mark); est host MB: the estimate's host share (offload; 0 without)")
    gpu = f"; {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})" if cuda else ""
    rows.append(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}{gpu}; python"
                f" {platform.python_version()}, torch {torch.__version__}, lightning {L.__version__}")
    return "\n".join(rows)
