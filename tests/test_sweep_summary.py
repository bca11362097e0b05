"""The sweep summary from a fake sweep dir (no training): one CSV row per job and a plot whose axes start at
zero, with the spread of step times and the memory estimate beside the measured memory."""

from __future__ import annotations

import csv
import json

import pytest

from lightning_shard.app import sweep

matplotlib = pytest.importorskip("matplotlib")

JOBS = [  # unit_size, units, median step, quartiles, peak gathered MiB, estimate MiB
    (800_000, 9, 1.31, (1.25, 1.40), 60.0, 235.0),
    (3_200_000, 3, 1.27, (1.26, 1.29), 160.0, 260.0),
    (12_800_000, 1, 1.29, (1.27, 1.35), 400.0, 320.0),
]


@pytest.fixture
def sweep_dir(tmp_path):
    for num, (unit_size, units, median, (q1, q3), gathered, estimated) in enumerate(JOBS):
        job = tmp_path / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- strategy.unit_size={unit_size}\n")
        (job / "summary.json").write_text(json.dumps({
            "sharding": "full", "unit_size": unit_size, "units": units, "world_size": 2, "steps": 12,
            "median_step_s": median, "q1_step_s": q1, "q3_step_s": q3, "model_state_mb_per_rank": 140.0,
            "estimated_mb_per_rank": estimated, "cuda_peak_mb_per_rank": None, "peak_gathered_mb_per_rank": gathered,
            "peak_rss_mb_per_rank": 900.0, "bytes_moved_mb_per_step": 300.0, "final_val_loss": 5.1}))
    return tmp_path


def test_one_row_per_job(sweep_dir):
    sweep.write(str(sweep_dir))
    rows = list(csv.DictReader(open(sweep_dir / "summary.csv")))
    assert [int(r["unit_size"]) for r in rows] == [j[0] for j in JOBS]
    assert [float(r["estimated_mb_per_rank"]) for r in rows] == [j[5] for j in JOBS]
    assert [float(r["q3_step_s"]) for r in rows] == [j[3][1] for j in JOBS]
    assert (sweep_dir / "summary.png").stat().st_size > 0


def test_plot_starts_at_zero_shows_the_spread_and_the_estimate(sweep_dir, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: saved.append(fig))
    sweep.write(str(sweep_dir))
    ax_time, ax_mem = saved[0].axes
    assert ax_time.get_ylim()[0] == 0 and ax_mem.get_ylim()[0] == 0  # a few percent look like a few percent
    (bars,) = ax_time.containers  # quartile bars around each median
    low, high = bars.lines[2][0].get_segments()[0][:, 1]
    assert (low, high) == pytest.approx(JOBS[0][3])
    labels = [text.get_text() for text in ax_mem.get_legend().get_texts()]
    assert "estimated peak before activations" in labels and "peak gathered units" in labels
    estimated = next(line for line in ax_mem.lines if line.get_label() == "estimated peak before activations")
    assert list(estimated.get_ydata()) == [j[5] for j in JOBS]
