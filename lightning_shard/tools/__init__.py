"""Benchmarks: step time against the anchors (``bench.py``), checkpoint save/load (``bench_checkpoint.py``), peak
memory of a 1.04B GPT (``bench_memory.py``), evaluation and generation (``bench_eval.py``), the engine's host
overhead (``bench_overhead.py``)."""

import os
import pickle
import socket
import tempfile
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on this host, for a benchmark's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(rank_main: Callable[..., None], world: int, args: Any) -> list:
    """Run ``rank_main(rank, world, args, port, out)`` in ``world`` processes, each pickling its result to
    ``f"{out}.{rank}"``; returns the ranks' results in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(rank_main, args=(world, args, free_port(), out), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(f"{out}.{rank}", "rb") as f:
                results.append(pickle.load(f))
    return results
