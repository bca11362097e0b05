"""After a Hydra multirun: one row per job (CSV) and a plot of unit size against step time and memory.

Runs by itself at the end of ``python -m lightning_shard.train -m ...`` (a Hydra callback), or by hand:
``python -m lightning_shard.app.sweep multirun/DATE/TIME``.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import sys
import warnings
from typing import Any

from hydra.experimental.callback import Callback

COLUMNS = ("job", "overrides", "unit_size", "units", "median_step_s", "peak_gathered_mb_per_rank",
           "model_state_mb_per_rank", "estimated_mb_per_rank", "cuda_peak_mb_per_rank", "peak_rss_mb_per_rank",
           "bytes_moved_mb_per_step", "final_train_loss", "final_val_loss")


def collect(sweep_dir: str) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(glob.glob(os.path.join(sweep_dir, "*", "summary.json")),
                       key=lambda p: int(os.path.basename(os.path.dirname(p))) if os.path.basename(os.path.dirname(p)).isdigit() else 0):
        job_dir = os.path.dirname(path)
        with open(path) as f:
            summary = json.load(f)
        overrides_file = os.path.join(job_dir, ".hydra", "overrides.yaml")
        overrides = open(overrides_file).read().replace("\n- ", " ").strip("- \n") if os.path.exists(overrides_file) else ""
        rows.append({"job": os.path.basename(job_dir), "overrides": overrides, **summary})
    return rows


def write(sweep_dir: str) -> list[dict[str, Any]]:
    rows = collect(sweep_dir)
    if not rows:
        warnings.warn(f"no job of {sweep_dir} wrote a summary.json")
        return rows
    with open(os.path.join(sweep_dir, "summary.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, os.path.join(sweep_dir, "summary.png"))
    return rows


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: summary.png not written (pip install matplotlib)")
        return
    rows = sorted((r for r in rows if r.get("unit_size")), key=lambda r: r["unit_size"])
    if not rows:
        return
    sizes = [r["unit_size"] for r in rows]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    ax_time.plot(sizes, [r["median_step_s"] for r in rows], "o-")
    ax_time.set(xscale="log", xlabel="unit_size (parameters)", ylabel="median step time (s)",
                title="too small: many collectives")
    ax_mem.plot(sizes, [r["peak_gathered_mb_per_rank"] for r in rows], "o-", label="peak gathered units")
    ax_mem.plot(sizes, [r["model_state_mb_per_rank"] for r in rows], "s--", label="params+grads+optimizer")
    ax_mem.set(xscale="log", xlabel="unit_size (parameters)", ylabel="MB per rank", title="too large: memory")
    ax_mem.legend()
    for ax, key in ((ax_time, "units"),):
        for r in rows:
            ax.annotate(f"{r[key]} units", (r["unit_size"], r["median_step_s"]), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class SweepSummary(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        rows = write(config.hydra.sweep.dir)
        if rows:
            print(f"sweep summary: {os.path.join(config.hydra.sweep.dir, 'summary.csv')} ({len(rows)} jobs)")


if __name__ == "__main__":
    for row in write(sys.argv[1]):
        print({k: row.get(k) for k in COLUMNS})
