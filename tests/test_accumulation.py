"""Gradient accumulation without reduction (reduce_during_accumulation=False) through real Trainers at 3 gloo ranks,
against Lightning's ddp (rtol 1e-5, atol 1e-6): a zero_grad between micro-batches drops what no_sync() held, a
value-keeping write does not, on every rank alike (tests/accumulation_scenarios.py)."""

from __future__ import annotations

import pytest

from tests import accumulation_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


def test_accumulation_with_writes_between_micro_batches_matches_ddp(tmp_path):
    results = run_world(scenarios.run, 3, list(scenarios.SCENARIOS), str(tmp_path), timeout=280)
    failed = {name: out for name, out in results[0].items() if out != "ok"}
    assert not failed, "\n\n".join(f"{name}: {out}" for name, out in failed.items())
