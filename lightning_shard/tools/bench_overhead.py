"""Host overhead benchmark: the time the engine's hooks take per step on a model of many small units, where
compute and communication are small and the engine's Python is what shows.

    python -m lightning_shard.tools.bench_overhead                  # 48 small blocks, 1 and 2 gloo ranks
    python -m lightning_shard.tools.bench_overhead --blocks 96 --width 32
    python -m lightning_shard.tools.bench_overhead --min-unit-size 200000   # also: the blocks merged into units

Per world size, interleaved over ``--rounds``: each rank alone (a plain loop, no engine) and the engine under
``full`` sharding (``shard_module``, no Lightning), the same model and batches. The engine's hooks (pre/post
forward, pre/post backward, the end of backward, the step's entry and exit) are timed from outside the engine,
each minus the time it spent waiting for a collective: *hook time* is the host work the engine adds, per step
and per unit. ``--min-unit-size``: also the engine with consecutive blocks merged into units of at least that many
parameters (``ShardStrategy(min_unit_size=...)``). At world 1 there is nothing to gather (a unit's gathered buffer
is its shard) and the step-time difference to alone is the whole overhead, autograd's share of the engine's hooks
included.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.tools import spawn_ranks

HOOKS = ("_enter_step", "_exit_step", "_pre_forward", "_post_forward", "_pre_backward", "_post_backward",
         "_finish_backward")


class SmallBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ManySmallUnits(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)  # the blocks' input in the compute dtype (CPU autocast keeps LayerNorm's)
        self.blocks = nn.ModuleList(SmallBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


class HookTimer:
    """Wraps the runtime's hook methods (the installed hooks look them up at each call): seconds spent in them,
    less the collective waits inside them (``stats.exposed_seconds``), and the number of calls."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        for name in HOOKS:
            setattr(runtime, name, self._timed(getattr(runtime, name)))

    def _timed(self, method: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # a hook called from another one is timed once, by the outer one
                return method(*args, **kwargs)
            self._depth += 1
            waited = self.runtime.stats.exposed_seconds
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                # the runtime resets its stats after a step: a wait counted before the reset is not subtracted
                waited = max(0.0, self.runtime.stats.exposed_seconds - waited)
                self.seconds += time.perf_counter() - start - waited
                self.calls += 1
                self._depth -= 1

        return timed


def _rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    from lightning_shard.engine.shard_module import shard_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(args.batch, args.seq, args.width, generator=g) for _ in range(args.steps + args.warmup)]
    mixed = args.precision == "bf16-mixed"  # as Lightning's: fp32 parameters, bf16 autocast; the engine gathers bf16
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed)
    configs = ["alone", "shard_full"] + (["shard_full merged"] if args.min_unit_size else [])
    results: dict[str, dict[str, list[float]]] = {name: {"step": [], "hooks": []} for name in configs}
    units: dict[str, int] = {}
    for _ in range(args.rounds):
        for name in results:
            torch.manual_seed(0)
            model = ManySmallUnits(args.blocks, args.width)
            timer = None
            if name != "alone":
                runtime = shard_module(model, sharding="full", param_dtype=torch.bfloat16 if mixed else None,
                                       min_unit_size=args.min_unit_size if name.endswith("merged") else None)
                timer, units[name] = HookTimer(runtime), len(runtime.units)
                opt = torch.optim.SGD(model.parameters(), lr=1e-3)
                runtime.attach_optimizer(opt)
                step = lambda: runtime.step(opt)  # noqa: E731
            else:
                opt = torch.optim.SGD(model.parameters(), lr=1e-3)
                step = opt.step
            dist.barrier()
            for i, batch in enumerate(batches):
                hooks_before = timer.seconds if timer else 0.0
                start = time.perf_counter()
                with autocast:
                    loss = model(batch)
                loss.backward()
                step()
                opt.zero_grad(set_to_none=True)
                if i >= args.warmup:
                    results[name]["step"].append(time.perf_counter() - start)
                    if timer:
                        results[name]["hooks"].append(timer.seconds - hooks_before)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"results": results, "units": units}, f)
    dist.destroy_process_group()


def _measure(args, world: int) -> dict:
    return spawn_ranks(_rank_main, world, args)[0]


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.bench_overhead", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=at_least(1), default=48, help="small blocks, one unit each (default: 48)")
    parser.add_argument("--width", type=at_least(1), default=64, help="default: 64")
    parser.add_argument("--batch", type=at_least(1), default=4, help="default: 4")
    parser.add_argument("--seq", type=at_least(1), default=16, help="default: 16")
    parser.add_argument("--world", type=at_least(1), nargs="+", default=[1, 2], help="default: 1 2")
    parser.add_argument("--steps", type=at_least(1), default=20, help="timed steps per round (default: 20)")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="default: 3")
    parser.add_argument("--rounds", type=at_least(1), default=3, help="default: 3")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true",
                        help="as Lightning's: bf16-mixed runs under bf16 autocast, and the engine gathers (at one rank:"
                             " casts) its fp32 shards to bf16; under 32-true one rank computes in the shards themselves"
                             " (default: 32-true)")
    parser.add_argument("--min-unit-size", type=at_least(1), default=None,
                        help="also run with the blocks merged into units of at least this many parameters")
    args = parser.parse_args(argv)
    params = sum(p.numel() for p in ManySmallUnits(args.blocks, args.width).parameters())
    header = (f"{'ranks':>5}  {'config':<17}  {'units':>5}  {'step ms':>8}  {'x alone':>7}"
              f"  {'hooks ms/step':>13}  {'hooks us/unit/step':>18}")
    rows = [header, "-" * len(header)]
    for world in args.world:
        report = _measure(args, world)
        alone = statistics.median(report["results"]["alone"]["step"]) * 1e3
        rows.append(f"{world:>5}  {'alone':<17}  {'-':>5}  {alone:>8.2f}  {1:>7.2f}  {'-':>13}  {'-':>18}")
        for name, units in report["units"].items():
            step = statistics.median(report["results"][name]["step"]) * 1e3
            hooks = statistics.median(report["results"][name]["hooks"]) * 1e3
            rows.append(f"{world:>5}  {name:<17}  {units:>5}  {step:>8.2f}  {step / alone:>7.2f}  {hooks:>13.2f}"
                        f"  {hooks * 1e3 / units:>18.1f}")
    rows.append(f"\nmodel: a Linear, {args.blocks} blocks (LayerNorm, Linear {args.width}->{2 * args.width}->{args.width}),"
                f" {params:,} parameters, {args.precision}; batch {args.batch}x{args.seq}; SGD; rank 0's medians over {args.rounds}"
                f" rounds x {args.steps} steps, 1 thread per rank")
    rows.append("hooks: time in the engine's hooks less their collective waits; at 1 rank there is nothing to gather")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
