"""The public commands keep their names after the move into layers, and run from any directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def run(cwd, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONWARNINGS": "default"})
    assert "found in sys.modules" not in proc.stderr  # a command imported twice under two names
    return proc


@pytest.mark.parametrize("command", ["lightning_shard.consolidate", "lightning_shard.bench"])
def test_help(tmp_path, command):
    proc = run(tmp_path, command, "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout


def test_estimate_reads_the_packaged_configs(tmp_path):
    proc = run(tmp_path, "lightning_shard.estimate", "model.model.width=32", "model.model.depth=2",
               "data.seq_len=32", "data.batch_size=4", "trainer.devices=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning_shard memory estimate per rank (2 ranks" in proc.stdout
    assert "peak" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written where it was called
