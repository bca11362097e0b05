"""Evaluation and generation benchmark: forwards without gradients under ``full`` sharding, every unit
re-gathered at each forward against every unit held gathered (``keep_gathered``), on N gloo ranks.

    python -m lightning_shard.tools.bench_eval                 # the step benchmark's 25M GPT, 2 ranks
    python -m lightning_shard.tools.bench_eval --tokens 64     # longer generation

Evaluation: ``--batches`` forwards of a batch of ``--batch`` sequences. Generation: greedy decoding of ``--tokens``
tokens from a ``--prompt``-token prompt, one forward per token (the model has no key-value cache), batch 1.
Runs interleaved over ``--rounds``; medians; all-gathers counted by the engine.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.app.models.gpt import GPT
from lightning_shard.tools import spawn_ranks


def _rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    from lightning_shard.engine.shard_module import shard_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.depth, args.heads, args.seq)
    runtime = shard_module(model, sharding="full")
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.batches)]
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=g)
    times: dict[str, list[float]] = {}
    gathers: dict[str, int] = {}
    model.eval()
    for _ in range(args.rounds):
        for held in (False, True):
            for task in ("evaluation", "generation"):
                name = f"{task}, {'held' if held else 're-gathered'}"
                dist.barrier()
                before = runtime.stats.all_gather_bytes
                start = time.perf_counter()
                with torch.no_grad(), runtime.keep_gathered() if held else nullcontext():
                    if task == "evaluation":
                        for batch in batches:
                            model(batch)
                    else:
                        tokens = prompt
                        for _ in range(args.tokens):
                            logits = model(tokens[:, -args.seq:])
                            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
                times.setdefault(name, []).append(time.perf_counter() - start)
                gathers[name] = runtime.stats.all_gather_bytes - before
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"times": times, "gathered": gathers, "held_bytes": runtime.held_bytes()}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.bench_eval", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    for option, default in (("world", 2), ("rounds", 3), ("batches", 8), ("batch", 8), ("tokens", 32), ("prompt", 16),
                            ("depth", 6), ("width", 512), ("heads", 8), ("seq", 128), ("vocab", 12000)):
        parser.add_argument(f"--{option}", type=at_least(1), default=default, help=f"default {default}")
    args = parser.parse_args(argv)
    result = spawn_ranks(_rank_main, args.world, args)[0]
    print(f"{'':<28}{'median s':>10}{'x held':>8}{'gathered MB':>13}")
    for name, times in result["times"].items():
        held = statistics.median(result["times"][name.split(",")[0] + ", held"])
        print(f"{name:<28}{statistics.median(times):>10.3f}{statistics.median(times) / held:>8.2f}"
              f"{result['gathered'][name] / 2**20:>13.1f}")
    print(f"\nGPT depth {args.depth}, width {args.width}, vocab {args.vocab}; full sharding on {args.world} gloo ranks, 1"
          f" thread each; evaluation: {args.batches} batches of {args.batch}x{args.seq}; generation: {args.tokens} tokens"
          f" from {args.prompt}, batch 1; held costs {result['held_bytes'] / 2**20:.1f} MiB per rank; medians of"
          f" {args.rounds} rounds")


if __name__ == "__main__":
    main()
