"""The lines a training run ends with: its final metrics, step time, memory per rank and where its outputs
are. Read back from the run's summary.json (written on rank 0 by ``RunSummary``), so that the process that
started the ranks prints it once, after they are gone."""

from __future__ import annotations

import glob
import json
import os
from typing import Any


def read_summary(output_dir: str) -> dict[str, Any]:
    path = os.path.join(output_dir, "summary.json")
    if not os.path.exists(path):  # callbacks=none: no RunSummary
        return {}
    with open(path) as f:
        return json.load(f)


def final_report(output_dir: str) -> str:
    s = read_summary(output_dir)
    lines = []
    if s:
        lines.append(f"done: {s['steps']} steps on {s['world_size']} rank(s), {s['sharding']} sharding,"
                     f" {s['precision']}")
        metrics = {"val_loss": s.get("final_val_loss"), **{k: v for k, v in s.items() if k.startswith("test_")}}
        lines.append("  " + "   ".join(f"{k} {v:.4g}" for k, v in metrics.items() if v is not None))
        if s.get("median_step_s") is not None:
            lines.append(f"  median step {s['median_step_s']:.3f} s")
        lines.append(f"  memory per rank: {_memory(s)}")
    lines.append(f"{'  ' if lines else 'done: '}outputs: {_shown(output_dir)}/  {', '.join(_outputs(output_dir))}")
    return "\n".join(lines)


def _memory(s: dict[str, Any]) -> str:
    parts = [f"{s['model_state_mb_per_rank']:.1f} MiB params+grads+optimizer"]
    if s.get("estimated_mb_per_rank") is not None:
        parts.append(f"{s['estimated_mb_per_rank']:.1f} MiB estimated before activations")
    if s.get("estimated_host_mb_per_rank") is not None:  # offload, async checkpoint staging
        parts.append(f"{s['estimated_host_mb_per_rank']:.1f} MiB estimated in host memory"
                     f" ({s.get('estimated_host_uses') or 'offload'})")
    if s.get("cuda_peak_mb_per_rank") is not None:
        parts.append(f"{s['cuda_peak_mb_per_rank']:.0f} MiB CUDA peak")
    else:  # the process's resident peak: torch and Python included
        parts.append(f"{s['peak_rss_mb_per_rank']:.0f} MiB process peak RSS")
    return ", ".join(parts)


def _outputs(output_dir: str) -> list[str]:
    """What a user looks for first: the summary, the checkpoint to resume from, the logged metrics."""
    found = [p for p in ("summary.json", "checkpoints/last.ckpt") if os.path.exists(os.path.join(output_dir, p))]
    if not found and os.path.isdir(os.path.join(output_dir, "checkpoints")):
        found.append("checkpoints/")
    found += sorted(os.path.relpath(p, output_dir) for p in glob.glob(os.path.join(output_dir, "**", "metrics.csv"),
                                                                       recursive=True))
    return found


def _shown(path: str) -> str:
    """Relative to the working directory when under it (``outputs/DATE/TIME``), else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
