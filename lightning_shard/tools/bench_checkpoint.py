"""Checkpoint benchmark: save and load times and per-rank memory growth, sharded vs full vs torch FSDP2 + DCP.

    python -m lightning_shard.tools.bench_checkpoint [--world 2] [--depth 6] [--width 512] [--rounds 3]

A GPT with AdamW state after one step, on ``--world`` gloo ranks (one thread each). Every figure is a
median over rounds; memory is the peak resident-set growth during the phase (sampled every 2 ms), the
most of any rank.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_shard.app.models.gpt import GPT


class PeakRSS:
    """Peak resident memory above the level at entry, in MiB."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.growth_mb = (max(self.peak, self._rss()) - self.start) / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trained(args, fsdp2: bool = False):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.depth, args.heads, args.seq)
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runtime = None
    else:
        from lightning_shard.engine.shard_module import shard_module

        runtime = shard_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, args.vocab, (2, args.seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(idx).float().mean().backward()
    optimizer.step()
    return model, runtime, optimizer


def _timed(fn) -> tuple[float, float]:
    dist.barrier()
    with PeakRSS() as peak:
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    growth = torch.tensor(peak.growth_mb)
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    return seconds, growth.item()


def _ours(args, directory: Path, kind: str) -> dict[str, tuple[float, float]]:
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.full import (
        full_optimizer_state_dict,
        full_state_dict,
        load_full_optimizer_state_dict,
        load_full_state_dict,
    )
    from lightning_shard.checkpoint.io import open_checkpoint, save_full, save_sharded

    model, runtime, optimizer = _trained(args)
    path = directory / f"{kind}.ckpt"

    def save() -> None:
        if kind == "sharded":
            save_sharded({"state_dict": sharded.model_state(runtime),
                          "optimizer_states": [sharded.optimizer_state(runtime, optimizer)]}, path)
            return
        checkpoint = {"state_dict": full_state_dict(runtime),
                      "optimizer_states": [full_optimizer_state_dict(runtime, optimizer)]}
        if dist.get_rank() == 0:
            save_full(checkpoint, path, TorchCheckpointIO())

    def load() -> None:
        checkpoint = open_checkpoint(path)
        source = checkpoint["state_dict"]
        if kind == "sharded":
            sharded.load_model_state(runtime, source.directory, source.metadata)
            sharded.load_optimizer_state(runtime, optimizer, 0, checkpoint["optimizer_states"][0],
                                         source.directory, source.metadata)
        else:
            load_full_state_dict(runtime, source)
            load_full_optimizer_state_dict(runtime, optimizer, checkpoint["optimizer_states"][0])

    return {"save": _timed(save), "load": _timed(load)}


def _fsdp2(args, directory: Path) -> dict[str, tuple[float, float]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, _, optimizer = _trained(args, fsdp2=True)
    path = str(directory / "fsdp2")

    def save() -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)

    def load() -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    return {"save": _timed(save), "load": _timed(load)}


def _rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    directory = Path(tempfile.mkdtemp(prefix="bench_ckpt_")) if rank == 0 else None
    holder = [str(directory)]
    dist.broadcast_object_list(holder)
    directory = Path(holder[0])
    results: dict[str, list] = {"sharded": [], "full": [], "fsdp2": []}
    for _ in range(args.rounds):
        results["sharded"].append(_ours(args, directory, "sharded"))
        results["full"].append(_ours(args, directory, "full"))
        results["fsdp2"].append(_fsdp2(args, directory))
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)
        shutil.rmtree(directory, ignore_errors=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    n_params = sum(p.numel() for p in GPT(args.vocab, args.width, args.depth, args.heads, args.seq).parameters())
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pkl")
        mp.start_processes(_rank_main, args=(args.world, args, port, out), nprocs=args.world, start_method="spawn")
        with open(out, "rb") as f:
            results = pickle.load(f)
    state_mb = n_params * 4 * 3 / 2**20  # weights + Adam's two moments, fp32
    print(f"GPT {n_params / 1e6:.1f}M parameters; weights + optimizer state {state_mb:.0f} MB; {args.world} gloo ranks;"
          f" medians of {args.rounds} rounds\n")
    print("| checkpoint | save s | load s | save: peak growth MB (worst rank) | load: peak growth MB (worst rank) |")
    print("|---|---|---|---|---|")
    labels = {"sharded": "lightning_shard `sharded`", "full": "lightning_shard `full`", "fsdp2": "torch FSDP2 + DCP"}
    for name, runs in results.items():
        med = lambda phase, i: statistics.median(r[phase][i] for r in runs)  # noqa: E731
        print(f"| {labels[name]} | {med('save', 0):.2f} | {med('load', 0):.2f} | {med('save', 1):.0f} |"
              f" {med('load', 1):.0f} |")


if __name__ == "__main__":
    main()
