"""Prefetch: the order of collectives, parity when the execution order changes, bytes against theory."""

import pytest

import torch

from tests.engine_scenarios import bytes_per_step, collective_trace, gathered_peak, parity
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)

AG, RS = "all_gather", "reduce"


def test_collective_order_without_prefetch():
    trace = run_world(collective_trace, 2, 0)[0]
    assert trace == [
        (AG, "<root>"), (AG, "blocks.0"), (AG, "blocks.1"), (AG, "blocks.2"),  # forward, one at a time
        (RS, "blocks.2"),  # blocks.2 was kept gathered for backward, which starts with it
        (AG, "blocks.1"), (RS, "blocks.1"), (AG, "blocks.0"), (RS, "blocks.0"),
        (RS, "<root>"),  # the root's gradients are reduced when backward ends
    ]


def test_collective_order_with_prefetch_one_unit_ahead():
    trace = run_world(collective_trace, 2, 1)[0]
    assert trace == [
        (AG, "<root>"), (AG, "blocks.0"),  # step start: the root, and the first unit already in flight
        (AG, "blocks.1"),  # launched as blocks.0 starts computing
        (AG, "blocks.2"),
        (AG, "blocks.1"),  # backward of blocks.2 begins: blocks.1 is gathered ahead, before blocks.2 reduces
        (RS, "blocks.2"), (AG, "blocks.0"), (RS, "blocks.1"), (RS, "blocks.0"), (RS, "<root>"),
    ]


def test_one_rank_casts_each_unit_as_it_runs_not_ahead():
    """One rank computing in bf16: a unit's gathered copy is a cast, made on the compute stream when the unit runs.
    Made ahead (prefetch) it would overlap nothing and hold two blocks' copies at once: one block and the root here."""
    r = run_world(gathered_peak, 1, 1, torch.bfloat16)[0]
    units = r["units"]
    assert r["peak"] == units["<root>"] + max(v for k, v in units.items() if k != "<root>"), r
    two = run_world(gathered_peak, 2, 1, torch.bfloat16)[0]  # two ranks: the next block's all-gather in flight
    assert two["peak"] > two["units"]["<root>"] + max(v for k, v in two["units"].items() if k != "<root>"), two


def test_changed_execution_order_warns_once_and_stays_exact():
    for report in run_world(parity, 2, "reorder", ("full", "grad_op")):
        assert all(r["order_warnings"] == 1 for r in report.values()), report


@pytest.mark.parametrize("mode", ["full", "grad_op", "none"])
def test_bytes_moved_agree_with_theory(mode):
    r = run_world(bytes_per_step, 2, mode)[0]
    stats, padded = r["stats"], r["padded"]
    psi = sum(padded.values())  # parameter bytes, as padded flat buffers
    if mode == "full":
        # 3 psi, less what is never gathered twice: the root (gathered for the whole step) and the last
        # unit (kept from its forward into its backward)
        assert stats["all_gather_bytes"] == 2 * psi - padded["<root>"] - padded[r["last"]]
        assert stats["reduce_scatter_bytes"] == psi
    elif mode == "grad_op":
        assert stats["all_gather_bytes"] == psi
        assert stats["reduce_scatter_bytes"] == psi
    else:
        assert stats["all_gather_bytes"] == 0
        assert stats["cross_group_bytes"] == 2 * psi  # the replicas' all-reduce, as DDP's
        assert stats["all_reduce_bytes"] == 0
