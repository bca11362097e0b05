"""The Hydra entry point: composed configs, overrides, bad overrides refused before launch, sweeps."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(900)

TINY = ["model.model.width=32", "model.model.depth=2", "data.seq_len=32", "data.batch_size=8",
        "trainer.max_steps=6", "trainer.val_check_interval=6", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "callbacks.run_summary.warmup_steps=1"]


def train(cwd, *overrides: str, warnings: str = "ignore") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_shard.train", *overrides], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": warnings, "HYDRA_FULL_ERROR": "0"})


def test_run_writes_logs_checkpoints_and_summary_into_one_dir(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(tmp_path, *TINY, f"hydra.run.dir={run_dir}", warnings="default")
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sharding"] == "full" and summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["units"] == 3 and summary["final_val_loss"] > 0
    assert summary["q1_step_s"] <= summary["median_step_s"] <= summary["q3_step_s"]
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert list((run_dir / "csv").glob("*/metrics.csv"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing stray

    # the run ends with its report, printed once (by the parent of the spawned ranks)
    report = proc.stdout[proc.stdout.index("done: "):].splitlines()
    assert proc.stdout.count("done: ") == 1
    assert report[0] == "done: 6 steps on 2 rank(s), full sharding, 32-true"
    assert f"test_loss {summary['test_loss']:.4g}" in report[1] and "val_loss" in report[1]
    assert report[2] == f"  median step {summary['median_step_s']:.3f} s"
    assert report[3].startswith("  memory per rank: ") and "estimated" in report[3]
    assert report[4] == "  outputs: run/  summary.json, checkpoints/last.ckpt, csv/version_0/metrics.csv"
    assert len(report) == 5

    # Lightning's deprecation warnings about its own code and its advertisements are filtered, in the ranks too
    assert "LeafSpec" not in proc.stderr and "Tip:" not in proc.stderr
    # and its note that the test sampler repeats samples, which this run's 2 test batches per rank never reach
    assert "DistributedSampler" not in proc.stderr


def test_overrides_from_the_command_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(tmp_path, *TINY, "strategy=grad_op", "strategy.unit_size=20000", "trainer.devices=2",
                 "precision=bf16-mixed", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sharding"] == "grad_op" and summary["unit_size"] == 20000 and summary["precision"] == "bf16-mixed"


def test_sweep_gives_one_dir_and_one_result_per_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = train(tmp_path, "-m", *TINY, "strategy.unit_size=15000,60000", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]
    jobs = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    rows = list(csv.DictReader(open(sweep_dir / "summary.csv")))
    assert [int(r["unit_size"]) for r in rows] == [15000, 60000]
    assert int(rows[0]["units"]) > int(rows[1]["units"])  # smaller budget, more units
    assert float(rows[0]["peak_gathered_mb_per_rank"]) < float(rows[1]["peak_gathered_mb_per_rank"])
