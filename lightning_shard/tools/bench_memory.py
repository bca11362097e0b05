"""Memory benchmark: a large GPT trained a few steps on N gloo ranks; each rank's peak resident memory against
one full replica's parameters, gradients and optimizer state, next to the strategy's own estimate.

    python -m lightning_shard.tools.bench_memory                        # 1.04B-parameter GPT, 2 ranks, AdamW
    python -m lightning_shard.tools.bench_memory --optimizer muon       # Muon for the matrices, AdamW for the rest
    python -m lightning_shard.tools.bench_memory --step-group-size 0    # the whole shard in one optimizer step

The model is built on the meta device and materialised unit by unit (as ``configure_model`` does), so no rank
ever holds all of it. Peak resident memory is the kernel's high-water mark of the process (``ru_maxrss``),
setup included; the replica figure is what one process would hold to train the model alone (fp32 parameters,
gradients and optimizer state). Needs about 11 GiB per rank at the default size: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.app.models.gpt import GPT
from lightning_shard.tools import spawn_ranks

GiB = 2**30


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _optimizers(model: torch.nn.Module, name: str) -> list[torch.optim.Optimizer]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    if name == "muon":
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-3)]
    return [torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                              lr=1e-3)]


class _Phases(dict):
    """Resident memory after each phase; printed as it goes with ``--verbose``."""

    def __init__(self, rank: int, verbose: bool) -> None:
        super().__init__()
        self.rank, self.verbose = rank, verbose

    def __setitem__(self, phase: str, value: int) -> None:
        super().__setitem__(phase, value)
        if self.verbose:
            print(f"rank {self.rank}: {phase}: RSS {value / GiB:.2f} GiB, peak {_peak_rss() / GiB:.2f} GiB", flush=True)


def _rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    from lightning_shard.engine.optim.optimizers import WHOLE, optimizer_kind
    from lightning_shard.engine.shard_module import shard_module
    from lightning_shard.memory.estimate import estimate_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    phases = _Phases(rank, args.verbose)
    phases["start"] = _rss()
    with torch.device("meta"):
        model = GPT(args.vocab, args.width, args.depth, args.heads, args.seq)
    params = sum(p.numel() for p in model.parameters())
    runtime = shard_module(model, device=torch.device("cpu"))
    with runtime.shaped_parameters():
        optimizers = _optimizers(model, args.optimizer)
    group = args.step_group_size or 2**62
    for optimizer in optimizers:
        runtime.attach_optimizer(optimizer, optimizer_kind(optimizer) == WHOLE, group)
    phases["sharded"] = _rss()
    first = runtime.optimizers.step_of(optimizers[0])
    estimate = estimate_sharded(runtime, "full", 1, type(optimizers[0]), first.whole, group)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        phases[f"forward {step}"] = _rss()
        loss.backward()
        del logits, loss
        phases[f"backward {step}"] = _rss()
        for optimizer in optimizers:
            runtime.step(optimizer)
        phases[f"step {step}"] = _rss()
        for optimizer in optimizers:
            optimizer.zero_grad()  # set_to_none, as Lightning does: gradient shards come back in backward
    state = sum(v.numel() * v.element_size() for o in optimizers for s in o.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"params": params, "peak": _peak_rss(), "phases": dict(phases), "estimate": estimate.as_dict(),
                     "state": state}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.bench_memory", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=at_least(1), default=2)
    parser.add_argument("--verbose", action="store_true", help="print each rank's memory after each phase")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--step-group-size", type=at_least(0), default=2**25,
                        help="parameter elements per rank stepped at once (0: all at once; default 2**25)")
    for option, default in (("depth", 20), ("width", 2048), ("heads", 16), ("seq", 128), ("vocab", 16000),
                            ("batch", 1), ("steps", 3)):
        parser.add_argument(f"--{option}", type=at_least(1), default=default, help=f"default {default}")
    args = parser.parse_args(argv)
    ranks = spawn_ranks(_rank_main, args.world, args)
    params = ranks[0]["params"]
    per_element = 16 if args.optimizer == "adamw" else 12  # fp32 parameter, gradient, two moments (Muon: one)
    replica = params * per_element
    print(f"GPT {params / 1e9:.3f}B parameters (depth {args.depth}, width {args.width}, vocab {args.vocab}, seq"
          f" {args.seq}, batch {args.batch}/rank), {args.world} gloo ranks, {args.optimizer}, step groups of"
          f" {args.step_group_size or 'all'} elements")
    print(f"one replica's parameters + gradients + optimizer state: {replica / GiB:.2f} GiB (1/N: {replica / args.world / GiB:.2f})")
    for rank, r in enumerate(ranks):
        print(f"rank {rank}: peak RSS {r['peak'] / GiB:.2f} GiB = {r['peak'] / replica:.2f}x a replica;"
              f" optimizer state {r['state'] / GiB:.2f} GiB; estimate {r['estimate']['peak'] / GiB:.2f} GiB")
    print("estimate (rank 0), GiB: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in ranks[0]["estimate"].items()))
    print("resident memory by phase (rank 0), GiB: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in ranks[0]["phases"].items()))


if __name__ == "__main__":
    main()
