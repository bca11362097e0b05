"""Value-keeping writes into the shard gradients between micro-batches
under no_sync() keep those micro-batches, against one process on the same global batch at 2 gloo ranks (rtol 1e-5,
atol 1e-6), and bit for bit against the same sharded model without them (bf16 base, fp32 adapter)."""

from __future__ import annotations

import pytest

from tests import gradient_write_scenarios as scenarios
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


def test_value_keeping_gradient_writes_between_micro_batches_keep_them():
    results = run_world(scenarios.run, 2, list(scenarios.cases()), timeout=280)
    failed = {name: out for name, out in results[0].items() if out != "ok"}
    assert not failed, "\n\n".join(f"{name}: {out}" for name, out in failed.items())
