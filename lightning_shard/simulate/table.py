"""The simulator's report: one row per strategy, the goals against FSDP2, and the calibration against torchtitan's
published Llama-3.1-8B run."""

from __future__ import annotations

import argparse
import math
from typing import Any, Optional

GiB = 2**30
# torchtitan's benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama 3.1 8B, 8 H100 (NVLink, 96 GB HBM2e,
# 500 W), FSDP2, bf16, no compile, local batch 2, selective activation checkpointing (sequence 8192, the 8B config's)
TORCHTITAN_8B = {"tokens_per_gpu": 5762, "memory_gib": 82.4}


def scaled(runs: list[dict], key: str, full_layers: Optional[int]) -> float:
    """``key`` of the last run, or, over two depths, extrapolated linearly to ``full_layers``."""
    values = [run.get(key) for run in runs]
    if any(v is None for v in values):
        return float("nan")
    if len(runs) < 2 or not full_layers:
        return float(values[-1])
    (a, va), (b, vb) = ((run["spec"]["layers"], v) for run, v in zip(runs[-2:], values[-2:]))
    return vb + (full_layers - b) * (vb - va) / (b - a)


def _estimate_peak(run: dict) -> Optional[float]:
    return run["estimate"]["peak"] if "estimate" in run else None


def rows(results: dict[str, list[dict]], args: argparse.Namespace, full_layers: Optional[int]) -> dict[str, dict]:
    """Per strategy: its figures (seconds, bytes), scaled to the whole model where it ran fewer layers."""
    out = {}
    for name in args.strategies:
        runs = results[name]
        for run in runs:
            run["estimate_peak"] = _estimate_peak(run)
            rate = run.get("copy_bytes_per_second")
            run["writes_seconds"] = run["written_bytes"] / rate if rate else None
        row = {key: scaled(runs, key, full_layers) for key in ("step", "modeled_comm", "peak", "peak_reserved",
                                                                 "estimate_peak", "engine_exposed")}
        zero = results.get(f"{name}@zero")
        row["zero_step"] = scaled(zero, "step", full_layers) if zero else float("nan")
        row["zero_writes"] = scaled(zero, "writes_seconds", full_layers) if zero else float("nan")
        row["exposed"] = row["step"] - row["zero_step"]
        row["tokens_per_gpu"] = args.batch * args.seq / row["step"]
        out[name] = row
    return out


def _gib(value: float) -> str:
    return "-" if math.isnan(value) else f"{value / GiB:.2f}"


def _s(value: float, digits: int = 4) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def format_report(results: dict[str, list[dict]], args: argparse.Namespace, preset: Any, header: str) -> str:
    table = rows(results, args, preset.full_layers if len(results[args.strategies[0]]) > 1 else None)
    lines = [header]
    if preset.full_layers and len(results[args.strategies[0]]) > 1:
        depths = [r["spec"]["layers"] for r in results[args.strategies[0]]]
        lines.append(f"figures extrapolated from {depths[0]} and {depths[1]} layers to {preset.full_layers}")
    lines += ["", "| strategy | step s | tokens/s/GPU | exposed comm s (% of step) | zero-cost step s |"
                  " link busy s (modeled) | peak GiB/rank | reserved GiB | estimate GiB (x peak) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        share = row["exposed"] / row["step"] if row["step"] else float("nan")
        ratio = row["estimate_peak"] / row["peak"] if row["peak"] else float("nan")
        estimate = "-" if math.isnan(row["estimate_peak"]) else f"{_gib(row['estimate_peak'])} ({ratio:.3f})"
        lines.append(f"| {name} | {_s(row['step'])} | {row['tokens_per_gpu']:,.0f} | {_s(row['exposed'])}"
                     f" ({share:.1%}) | {_s(row['zero_step'])} | {_s(row['modeled_comm'])} | {_gib(row['peak'])} |"
                     f" {_gib(row['peak_reserved'])} | {estimate} |")
    lines.append("")
    for name, row in table.items():
        if not math.isnan(row["zero_writes"]):
            lines.append(f"{name}: the zero-cost step holds {row['zero_writes'] * 1e3:.2f} ms of stand-in writes"
                         f" ({row['zero_writes'] / row['zero_step']:.1%} of it) beyond the rank's compute")
        if name == "ours" and not math.isnan(row["engine_exposed"]):
            lines.append(f"ours: the engine's own exposed figure (events on its streams, or host waits): "
                         f"{row['engine_exposed']:.4f} s")
    if "ours" in table and "fsdp2" in table:
        ours, fsdp2 = table["ours"], table["fsdp2"]
        lines.append(f"ours / FSDP2: step {ours['step'] / fsdp2['step']:.3f}x (goal <= 0.9), peak"
                     f" {ours['peak'] / fsdp2['peak']:.3f}x (goal <= 1)")
    if "ours" in table:
        ours = table["ours"]
        lines.append(f"ours: exposed communication {ours['exposed'] / ours['step']:.1%} of the step (goal < 5%);"
                     f" estimate {ours['estimate_peak'] / ours['peak']:.3f}x the measured peak (goal within 5%)")
    if preset.name == "llama3-8b" and "fsdp2" in table and args.device == "cuda":
        fsdp2 = table["fsdp2"]
        lines.append(f"calibration, FSDP2 against torchtitan's published run (8 H100 SXM at 500 W, HBM2e, NVLink;"
                     f" FSDP2, bf16, local batch 2, sequence 8192, selective checkpointing): predicted"
                     f" {fsdp2['tokens_per_gpu']:,.0f} tokens/s/GPU against {TORCHTITAN_8B['tokens_per_gpu']:,}"
                     f" ({fsdp2['tokens_per_gpu'] / TORCHTITAN_8B['tokens_per_gpu']:.2f}x), reserved"
                     f" {_gib(fsdp2['peak_reserved'])} GiB against {TORCHTITAN_8B['memory_gib']} GiB")
    return "\n".join(lines)
