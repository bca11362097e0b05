"""Host overhead benchmark: the time the engine's hooks take per step on a model of many small units, where
compute and communication are small and the engine's Python is what shows.

    python -m lightning_shard.tools.bench_overhead                  # 48 small blocks, 1 and 2 gloo ranks
    python -m lightning_shard.tools.bench_overhead --blocks 96 --width 32
    python -m lightning_shard.tools.bench_overhead --min-unit-size 200000   # also: the blocks merged into units
    python -m lightning_shard.tools.bench_overhead --device cuda --world 1 --precision bf16-mixed --hooks

Per world size, interleaved step by step (each step of alone, then the engine's, ``--rounds`` times with fresh
models): each rank alone (a plain loop, no engine) and the engine under ``full`` sharding (``shard_module``, no
Lightning), the same model and batches; "x alone" is the median of each step's ratio to alone's step beside it, so
that a slow second of a shared machine slows both sides of a ratio. The engine's hooks (pre/post
forward, pre/post backward, the end of backward, the step's entry and exit) are timed from outside the engine,
each minus the time it spent waiting for a collective: *hook time* is the host work the engine adds, per step
and per unit. ``--min-unit-size``: also the engine with consecutive blocks merged into units of at least that many
parameters (``ShardStrategy(min_unit_size=...)``). At world 1 there is nothing to gather (a unit's gathered buffer
is its shard) and the step-time difference to alone is the whole overhead, autograd's share of the engine's hooks
included.

``--device cuda`` runs each rank on its own GPU (NCCL), each step timed to a device synchronisation. The model is so
small that the GPU is idle most of the step: the difference to alone is the time the GPU waits for the engine's host
work, issue 30's "GPU idle per unit". ``--hooks`` adds each hook's share per unit per step.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.tools import spawn_ranks

# each hook, and the runtime's part that runs it (the installed hooks look its method up at each call)
HOOKS = {"enter_step": "scope", "exit_step": "scope", "pre_forward": "hooks", "post_forward": "hooks",
         "pre_backward": "hooks", "post_backward": "hooks", "finish_backward": "hooks"}


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
    """Wraps the hook methods of the runtime's parts (the installed hooks look them up at each call): seconds spent
    in them, less the collective waits inside them (``stats.exposed_seconds``), in all and per hook."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.seconds = 0.0
        self.by_hook = dict.fromkeys(HOOKS, 0.0)
        self._depth = 0
        for name, part in HOOKS.items():
            owner = getattr(runtime, part)
            setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name: str, method: Callable) -> Callable:
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
                spent = time.perf_counter() - start - waited
                self.seconds += spent
                self.by_hook[name] += spent
                self._depth -= 1

        return timed


def _rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    from lightning_shard.engine.shard_module import shard_module

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=10))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(args.batch, args.seq, args.width, generator=g).to(device)
               for _ in range(args.steps + args.warmup)]
    mixed = args.precision == "bf16-mixed"  # as Lightning's: fp32 parameters, bf16 autocast; the engine gathers bf16
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed)
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    configs = ["alone", "shard_full"] + (["shard_full merged"] if args.min_unit_size else [])
    results: dict[str, dict[str, list]] = {name: {"step": [], "hooks": [], "by_hook": []} for name in configs}
    units: dict[str, int] = {}

    def build(name: str) -> tuple[nn.Module, Callable[[], None], torch.optim.Optimizer, Optional[HookTimer]]:
        torch.manual_seed(0)
        model = ManySmallUnits(args.blocks, args.width).to(device)
        if name == "alone":
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            return model, opt.step, opt, None
        runtime = shard_module(model, sharding="full", param_dtype=torch.bfloat16 if mixed else None,
                               min_unit_size=args.min_unit_size if name.endswith("merged") else None, device=device)
        units[name] = len(runtime.units)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        runtime.attach_optimizer(opt)
        return model, lambda: runtime.step(opt), opt, HookTimer(runtime)

    for _ in range(args.rounds):
        runs = {name: build(name) for name in configs}
        dist.barrier()
        for i, batch in enumerate(batches):
            for name, (model, step, opt, timer) in runs.items():  # step by step: a slow second hits every config
                hooks_before = timer.seconds if timer else 0.0
                by_hook_before = dict(timer.by_hook) if timer else {}
                synchronize()
                start = time.perf_counter()
                with autocast:
                    loss = model(batch)
                loss.backward()
                step()
                opt.zero_grad(set_to_none=True)
                synchronize()
                if i >= args.warmup:
                    results[name]["step"].append(time.perf_counter() - start)
                    if timer:
                        results[name]["hooks"].append(timer.seconds - hooks_before)
                        results[name]["by_hook"].append({k: v - by_hook_before[k] for k, v in timer.by_hook.items()})
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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank, NCCL, steps timed to a device synchronisation (default: cpu)")
    parser.add_argument("--hooks", action="store_true", help="also each hook's time per unit per step")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < max(args.world):
        parser.error(f"--device cuda --world {max(args.world)}: {torch.cuda.device_count()} CUDA device(s) here")
    params = sum(p.numel() for p in ManySmallUnits(args.blocks, args.width).parameters())
    header = (f"{'ranks':>5}  {'config':<17}  {'units':>5}  {'step ms':>8}  {'x alone':>7}"
              f"  {'hooks ms/step':>13}  {'hooks us/unit/step':>18}")
    rows = [header, "-" * len(header)]
    for world in args.world:
        report = _measure(args, world)
        alone = statistics.median(report["results"]["alone"]["step"]) * 1e3
        rows.append(f"{world:>5}  {'alone':<17}  {'-':>5}  {alone:>8.2f}  {1:>7.2f}  {'-':>13}  {'-':>18}")
        for name, units in report["units"].items():
            steps = report["results"][name]["step"]
            step = statistics.median(steps) * 1e3
            ratio = statistics.median(s / a for s, a in zip(steps, report["results"]["alone"]["step"]))
            hooks = statistics.median(report["results"][name]["hooks"]) * 1e3
            rows.append(f"{world:>5}  {name:<17}  {units:>5}  {step:>8.2f}  {ratio:>7.2f}  {hooks:>13.2f}"
                        f"  {hooks * 1e3 / units:>18.1f}")
            if args.hooks:
                rows.append(_per_hook(report["results"][name]["by_hook"], units))
    rows.append(f"\nmodel: a Linear, {args.blocks} blocks (LayerNorm, Linear {args.width}->{2 * args.width}->{args.width}),"
                f" {params:,} parameters, {args.precision}; batch {args.batch}x{args.seq}; SGD; rank 0's medians over {args.rounds}"
                f" rounds x {args.steps} steps, the configurations interleaved step by step (x alone: the median of"
                f" each step's ratio to alone's step beside it), 1 thread per rank"
                + (", one GPU per rank (NCCL), each step timed to a device synchronisation" if args.device == "cuda" else ""))
    rows.append("hooks: time in the engine's hooks less their collective waits; at 1 rank there is nothing to gather")
    print("\n".join(rows), flush=True)


def _per_hook(steps: list[dict[str, float]], units: int) -> str:
    """Each hook's median time per unit per step, in µs, on one line under its configuration's row."""
    return "         hooks us/unit/step: " + ", ".join(
        f"{name} {statistics.median(step[name] for step in steps) * 1e6 / units:.1f}" for name in HOOKS)


if __name__ == "__main__":
    main()
