"""Export benchmark: what writing a Hugging Face folder costs a process's memory, from a sharded checkpoint on disk
(``python -m lightning_shard.export``, one process) and from the live sharded model (``save_pretrained``, rank 0),
against the bound they promise: the largest unit plus one output file's tensors, never the whole model.

    python -m lightning_shard.tools.bench_export                      # 185M GPT, 2 ranks, files of 100 MB
    python -m lightning_shard.tools.bench_export --max-shard-size 50MB

A GPT is built on the meta device, sharded over gloo ranks, trained one AdamW step (so the checkpoint holds
optimizer state too, which an export must not read) and checkpointed sharded. Each export's growth is its process's
peak resident memory during the export (the kernel's high-water mark, reset just before) less its resident memory
just before; the export from disk runs in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.app.models.gpt import GPT
from lightning_shard.checkpoint.safetensors_writer import _return_freed_memory, parse_size
from lightning_shard.tools import free_port

MB = 10**6


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Memory freed earlier (training) handed back first, so that the export cannot hide in it; then the high-water
    mark starts again from here."""
    _return_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the high-water mark
        f.write("5")


def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _rank_main(rank: int, world: int, args, port: int, work: str) -> None:
    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.export import save_pretrained
    from lightning_shard.checkpoint.io import save_sharded
    from lightning_shard.engine.shard_module import shard_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    with torch.device("meta"):
        model = GPT(args.vocab, args.width, args.depth, args.heads, args.seq)
    runtime = shard_module(model, device=torch.device("cpu"))
    with runtime.shaped_parameters():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime.attach_optimizer(optimizer)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(rank))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    runtime.step(optimizer)
    save_sharded({"state_dict": sharded.model_state(runtime),
                  "optimizer_states": [sharded.optimizer_state(runtime, optimizer)]}, Path(work) / "checkpoint")
    optimizer.zero_grad()
    dist.barrier()
    _reset_peak()
    before = _rss()
    save_pretrained(model, Path(work) / "live", max_shard_size=args.max_shard_size)
    if rank == 0:
        units = [u.storage.padded_numel * u.storage.shard.element_size() for u in runtime.units]
        report = {"params": sum(s.numel for u in runtime.units for s in u.storage.slots), "largest_unit": max(units),
                  "live_growth": _peak() - before}
        (Path(work) / "live.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


_FROM_DISK = """
import json, os, sys
from lightning_shard.checkpoint.export_checkpoint import export_checkpoint
from lightning_shard.tools.bench_export import _peak, _reset_peak, _rss
_reset_peak()
before = _rss()
export_checkpoint(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3])
print(json.dumps({"disk_growth": _peak() - before}))
"""


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.bench_export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=at_least(1), default=2)
    parser.add_argument("--max-shard-size", default="100MB", help="bytes per output file (default 100MB)")
    for option, default in (("depth", 12), ("width", 1024), ("heads", 16), ("seq", 64), ("vocab", 32000)):
        parser.add_argument(f"--{option}", type=at_least(1), default=default, help=f"default {default}")
    args = parser.parse_args(argv)
    limit = parse_size(args.max_shard_size)
    with tempfile.TemporaryDirectory() as work:
        mp.spawn(_rank_main, args=(args.world, args, free_port(), work), nprocs=args.world, join=True)
        report = json.loads((Path(work) / "live.json").read_text())
        done = subprocess.run([sys.executable, "-c", _FROM_DISK, str(Path(work) / "checkpoint"), str(Path(work) / "disk"),
                               args.max_shard_size], capture_output=True, text=True, check=True)
        report.update(json.loads(done.stdout.strip().splitlines()[-1]))
        files = sorted(p.name for p in (Path(work) / "disk").iterdir())
        written = sum(p.stat().st_size for p in (Path(work) / "disk").iterdir())
    params, unit = report["params"], report["largest_unit"]
    print(f"GPT {params / 1e6:.0f}M parameters ({params * 4 / MB:.0f} MB fp32; depth {args.depth}, width {args.width},"
          f" vocab {args.vocab}), sharded checkpoint with AdamW state from {args.world} gloo ranks;"
          f" {len(files) - 1} files of at most {limit / MB:.0f} MB ({written / MB:.0f} MB written)")
    print(f"bound: largest unit {unit / MB:.0f} MB + one file {limit / MB:.0f} MB = {(unit + limit) / MB:.0f} MB")
    print(f"export from the checkpoint on disk (one process): peak growth {report['disk_growth'] / MB:.0f} MB")
    print(f"export from the live model (rank 0 of {args.world}): peak growth {report['live_growth'] / MB:.0f} MB")


if __name__ == "__main__":
    main()
