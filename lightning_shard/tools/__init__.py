"""Benchmarks: step time against the anchors (``bench.py``), checkpoint save/load (``bench_checkpoint.py``), peak
memory of a 1.04B GPT (``bench_memory.py``), evaluation and generation (``bench_eval.py``), the engine's host
overhead (``bench_overhead.py``)."""

import importlib.util
import os
import pickle
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

# A benchmark's processes fork from one server process that imported these once (each spawned process re-imported
# them: 25-60 s a process on a GPU machine, most of a benchmark's time). Nothing there touches a GPU before the fork.
PRELOAD = ("torch", "torch.distributed", "lightning", "transformers", "lightning_shard", "lightning_shard.tools.bench")


def free_port() -> int:
    """A free TCP port on this host, for a benchmark's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([m for m in PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None])
    return context


def _run_rank(rank_main: Callable[..., None], rank: int, *args: Any) -> None:
    try:
        rank_main(rank, *args)
    except BaseException:
        out = args[-1]
        with open(f"{out}.{rank}.error", "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)


def spawn_ranks(rank_main: Callable[..., None], world: int, args: Any) -> list:
    """Run ``rank_main(rank, world, args, port, out)`` in ``world`` processes (forked from the preloaded server),
    each pickling its result to ``f"{out}.{rank}"``; returns the ranks' results in rank order, or raises with the
    failing ranks' tracebacks."""
    context = _context()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        port = free_port()
        procs = [context.Process(target=_run_rank, args=(rank_main, rank, world, args, port, out))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        failed = [rank for rank, proc in enumerate(procs) if proc.exitcode != 0]
        if failed:
            errors = [open(f"{out}.{r}.error").read() for r in failed if os.path.exists(f"{out}.{r}.error")]
            raise RuntimeError(f"ranks {failed} failed (exit codes {[procs[r].exitcode for r in failed]}):\n"
                               + "\n".join(errors))
        results = []
        for rank in range(world):
            with open(f"{out}.{rank}", "rb") as f:
                results.append(pickle.load(f))
    return results
