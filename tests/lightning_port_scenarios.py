"""Scenarios of Lightning's own strategy tests (FSDPStrategy, ModelParallelStrategy, DDP and the strategy-generic
ones, ``tests/tests_pytorch/strategies/``), ported to ShardStrategy at 2 gloo ranks; run by test_lightning_port.py.

Each scenario runs in a world's ranks (``tests/world.py``: the Trainers there see their rank in the environment and
start no processes) and either checks what Lightning's test checks, against Lightning's ``ddp`` in the same world
where numbers are involved (fp32, 1e-5 relative, 1e-6 absolute), or returns what a refusal said. Several scenarios run
per world; each returns a dict, or raises on every rank (``run_scenarios`` records the error and goes on).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script, below

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests import lightning_port_checkpoints, lightning_port_loops, lightning_port_modules  # noqa: E402,F401
from tests import lightning_port_state_dicts  # noqa: E402,F401  (each registers its scenarios)
from tests.lightning_port_models import SCENARIOS  # noqa: E402
from tests.world import as_lightning_rank, leave_lightning_app  # noqa: E402


def run_scenarios(rank: int, world: int, names: list[str], root: str, launched: bool = False) -> dict[str, Any]:
    """Each named scenario in turn, in its own directory: its result, or the error it raised (as text).
    ``launched``: this process was started by Lightning's launcher (see :func:`main`), not by a test world."""
    if not launched:
        as_lightning_rank(rank, world)
    for name in ("lightning.pytorch", "lightning.fabric"):  # Lightning's and the strategy's notes, on each Trainer
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {}
    for name in names:
        torch.manual_seed(0)
        directory = Path(root) / name
        started = time.perf_counter()
        try:
            results[name] = SCENARIOS[name](rank, world, directory)
        except Exception:  # noqa: BLE001 - reported per scenario; the ranks raised alike or the world hangs
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - started, 1)
        dist.barrier()
    return results


def main() -> None:
    """``python tests/lightning_port_scenarios.py OUT NAME...``: the scenarios in a script whose first Trainer
    starts the other rank through Lightning's subprocess launcher (re-running this command), as Lightning's
    standalone strategy tests run; rank 0 saves what each returned to OUT/results.pt."""
    out, names = sys.argv[1], sys.argv[2:]
    results = run_scenarios(int(os.environ.get("LOCAL_RANK", 0)), 2, names, out, launched=True)
    leave_lightning_app(results, out)


if __name__ == "__main__":
    main()
