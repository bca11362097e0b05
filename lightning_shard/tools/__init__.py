"""Benchmarks: step time against the anchors (``bench.py``) and checkpoint save/load (``bench_checkpoint.py``)."""
