"""Benchmarks: step time against the anchors (``bench.py``), checkpoint save/load (``bench_checkpoint.py``), peak
memory of a 1.04B GPT (``bench_memory.py``), evaluation and generation (``bench_eval.py``), the engine's host
overhead (``bench_overhead.py``)."""

import socket


def free_port() -> int:
    """A free TCP port on this host, for a benchmark's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
