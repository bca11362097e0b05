"""After a Hydra multirun: one row per job (CSV) and a plot of unit size against step time and memory.

Runs by itself at the end of ``python -m lightning_shard.train -m ...`` (a Hydra callback), or by hand:
``python -m lightning_shard.app.sweep multirun/DATE/TIME``.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import warnings
from typing import Any, Optional

from hydra.experimental.callback import Callback

from lightning_shard.app import cli

COLUMNS = ("job", "overrides", "unit_size", "units", "median_step_s", "q1_step_s", "q3_step_s",
           "peak_gathered_mb_per_rank", "model_state_mb_per_rank", "estimated_mb_per_rank", "cuda_peak_mb_per_rank",
           "peak_rss_mb_per_rank", "bytes_moved_mb_per_step", "final_train_loss", "final_val_loss")
PROG = "python -m lightning_shard.app.sweep"


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
    fig = figure(rows)
    if fig is not None:
        fig.savefig(path, dpi=100)
        plt.close(fig)


def figure(rows: list[dict[str, Any]]) -> Any:
    """Unit size against step time and memory per rank; None when no job has a unit size.

    Axes start at zero: a step time that varies by a few percent should look like it. Bars span the quartiles
    of each job's timed steps; the estimate (made at setup, before activations) stands beside what was measured.
    """
    import matplotlib.pyplot as plt

    rows = sorted((r for r in rows if r.get("unit_size")), key=lambda r: r["unit_size"])
    if not rows:
        return None
    sizes = [r["unit_size"] for r in rows]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    medians = [r["median_step_s"] for r in rows]
    spread = None
    if all(r.get("q1_step_s") is not None for r in rows):  # older summaries have the median only
        spread = [[m - r["q1_step_s"] for m, r in zip(medians, rows)],
                  [r["q3_step_s"] - m for m, r in zip(medians, rows)]]
    ax_time.errorbar(sizes, medians, yerr=spread, fmt="o-", capsize=3)
    for r in rows:
        ax_time.annotate(f"{r['units']} unit{'s' if r['units'] != 1 else ''}", (r["unit_size"], r["median_step_s"]),
                         textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_time.set(xscale="log", xlabel="unit_size (parameters)", ylabel="step time (s): median, quartiles",
                title="too small: many collectives")
    series = [("peak_gathered_mb_per_rank", "o-", "peak gathered units"),
              ("model_state_mb_per_rank", "s-", "params+grads+optimizer"),
              ("cuda_peak_mb_per_rank", "^-", "CUDA peak (measured)"),
              ("estimated_mb_per_rank", "x--", "estimated peak before activations")]
    for key, style, label in series:
        if all(r.get(key) is not None for r in rows):
            ax_mem.plot(sizes, [r[key] for r in rows], style, label=label)
    ax_mem.set(xscale="log", xlabel="unit_size (parameters)", ylabel="MiB per rank", title="too large: memory")
    ax_mem.legend(fontsize=8)
    for ax in (ax_time, ax_mem):
        ax.set_ylim(bottom=0)
        ax.margins(x=0.1)  # room for the last point's label
    fig.tight_layout()
    return fig


def _written(sweep_dir: str, rows: list[dict[str, Any]]) -> str:
    files = [f for f in ("summary.csv", "summary.png") if os.path.exists(os.path.join(sweep_dir, f))]
    return f"sweep summary ({len(rows)} jobs): {', '.join(os.path.join(sweep_dir, f) for f in files)}"


class SweepSummary(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        rows = write(config.hydra.sweep.dir)
        if rows:
            print(_written(config.hydra.sweep.dir, rows))


def main(argv: Optional[list[str]] = None) -> None:
    parser = cli.ArgumentParser(prog=PROG, description="One row per job of a finished sweep (summary.csv) and a"
                                " plot of unit size against step time and memory (summary.png), in the sweep dir.")
    parser.add_argument("sweep_dir", help="a python -m lightning_shard.train -m ... dir, e.g. multirun/DATE/TIME")
    sweep_dir = parser.parse_args(argv).sweep_dir
    if not collect(sweep_dir):
        cli.fail(PROG, f"no job of {sweep_dir!r} wrote a summary.json (is it a sweep dir?)")
    print(_written(sweep_dir, write(sweep_dir)))


if __name__ == "__main__":
    main()
