"""The engine's host cost per unit against another git revision's, on a machine whose speed drifts: two processes,
one running the working tree's engine and one running ``REV``'s, take turns step by step, so that a slow second
slows both sides of each step's ratio.

    python -m lightning_shard.tools.bench_against HEAD~3 --precision bf16-mixed --width 8
    python -m lightning_shard.tools.bench_against main --steps 300

One rank each (``shard_module``, ``full`` sharding, no Lightning) on ``bench_overhead``'s model of many small units:
at one rank nothing is communicated, so a step's difference between the two is the difference in the engine's
own host work. A small ``--width`` leaves little else in the step. Also runs ``REV`` against itself (its second
process), which shows the noise floor of the comparison. Needs git and the revision's ``lightning_shard/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lightning_shard.app.cli import ArgumentParser, at_least

# Runs in each process, importing lightning_shard from the tree its PYTHONPATH puts first: one step per line read.
_SIDE = r"""
import json, sys, time, torch
from lightning_shard.engine.shard_module import shard_module
from lightning_shard.tools.bench_overhead import ManySmallUnits
blocks, width, mixed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "bf16-mixed"
torch.set_num_threads(1)
torch.manual_seed(0)
model = ManySmallUnits(blocks, width)
runtime = shard_module(model, sharding="full", param_dtype=torch.bfloat16 if mixed else None,
                       device=torch.device("cpu"))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
runtime.attach_optimizer(optimizer)
batch = torch.randn(4, 16, width, generator=torch.Generator().manual_seed(0))
print(json.dumps({"units": len(runtime.units)}), flush=True)
for _ in sys.stdin:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        loss = model(batch)
    loss.backward()
    runtime.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    print(json.dumps({"seconds": time.perf_counter() - start, "loss": loss.item()}), flush=True)
"""

SIDES = ("REV", "REV again", "working tree")


WORKING_TREE = Path(__file__).resolve().parents[2]


def _tree_of(revision: str, into: Path) -> Path:
    """``revision``'s ``lightning_shard/`` package, extracted under ``into``; ValueError if git cannot give it."""
    try:
        archive = subprocess.run(["git", "-C", str(WORKING_TREE), "archive", revision, "lightning_shard"],
                                 check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        detail = err.stderr.decode().strip() if isinstance(err, subprocess.CalledProcessError) else str(err)
        raise ValueError(f"cannot read revision {revision!r} from git in {WORKING_TREE}: {detail.splitlines()[0]}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _start(tree: Path, args) -> subprocess.Popen:
    # `python -c` puts its working directory first on sys.path: the tree's, so that it imports that tree's package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", _SIDE, str(args.blocks), str(args.width), args.precision],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree)


def _read(side: subprocess.Popen) -> dict:
    line = side.stdout.readline()
    if not line:
        raise SystemExit(f"bench_against: a side exited with code {side.wait()}")
    return json.loads(line)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.bench_against", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revision", help="the git revision to compare the working tree with (HEAD, main, a commit)")
    parser.add_argument("--blocks", type=at_least(1), default=48, help="small blocks, one unit each (default: 48)")
    parser.add_argument("--width", type=at_least(1), default=8, help="default: 8")
    parser.add_argument("--steps", type=at_least(1), default=150, help="timed steps per side (default: 150)")
    parser.add_argument("--warmup", type=at_least(0), default=10, help="default: 10")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="bf16-mixed",
                        help="as bench_overhead's (default: bf16-mixed)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            revision_tree = _tree_of(args.revision, Path(tmp))
        except ValueError as err:
            parser.error(str(err))
        sides = [_start(tree, args) for tree in (revision_tree, revision_tree, WORKING_TREE)]
        try:
            units = [_read(side)["units"] for side in sides]
            seconds: list[list[float]] = [[] for _ in sides]
            losses: list[float] = [0.0] * len(sides)
            for step in range(args.warmup + args.steps):
                for i, side in enumerate(sides):  # one at a time: never two steps at once
                    side.stdin.write("\n")
                    side.stdin.flush()
                    result = _read(side)
                    if step >= args.warmup:
                        seconds[i].append(result["seconds"])
                    losses[i] = result["loss"]
        finally:
            for side in sides:
                side.stdin.close()
                side.wait()
    base = seconds[0]
    print(f"{'side':<14}  {'step ms':>8}  {'x REV':>6}  {'us/unit/step vs REV':>20}  last loss")
    for name, times, loss, n in zip(SIDES, seconds, losses, units):
        ratio = statistics.median(t / b for t, b in zip(times, base))
        per_unit = statistics.median((t - b) / n * 1e6 for t, b in zip(times, base))
        print(f"{name:<14}  {statistics.median(times) * 1e3:>8.2f}  {ratio:>6.3f}  {per_unit:>+20.1f}  {loss:.6g}")
    print(f"\nREV = {args.revision}; {args.blocks} blocks of width {args.width}, {args.precision}, one rank, {units[0]}"
          f" units; medians over {args.steps} steps, the three processes taking turns step by step (ratios: each"
          " step's against REV's step beside it)")


if __name__ == "__main__":
    main()
