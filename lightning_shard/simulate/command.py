"""python -m lightning_shard.simulate: the step of a world of N GPUs, predicted on one, ours beside FSDP2.

    python -m lightning_shard.simulate                                    # CPU: the small GPT, world 8, NVLink
    python -m lightning_shard.simulate --device cuda --world 8 --link h100-nvlink --model llama-840m
    python -m lightning_shard.simulate --device cuda --model llama3-8b   # with torchtitan's figure beside FSDP2's

Each strategy runs in a process of its own as rank 0 of a simulated world (lightning_shard/simulate/backend.py):
collectives move no data and hold their stream for the time the link's cost model gives (links.py: latency +
bytes x factor / bus bandwidth, cited nccl-tests figures). Each also runs with the cost model at zero: that step is
the rank's compute alone (plus the stand-ins' device writes, printed), and the difference is the communication the
step exposed. Memory is this rank's, real: shards are 1/N of their size, gathered units whole (every rank's shards
are the same size, padded, so rank 0 stands for all). On the CPU (``--device cpu``) the times are the CPU's compute
with modeled waits: they predict nothing of a GPU, the memory is exact.

Printed per strategy: the predicted step (median), tokens/s per GPU, exposed communication (step - zero-cost step),
the link's modeled busy time per step, this rank's peak memory (CUDA: max_memory_allocated, and reserved as
torchtitan reports) and lightning_shard's estimate of it.
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import replace
from typing import Any, Optional

import torch

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.simulate.links import LINKS, NODE_LINKS
from lightning_shard.simulate.models import MODELS
from lightning_shard.simulate.occupancy import SHARING
from lightning_shard.simulate.run import OFFLOADS, PRECISIONS, STRATEGIES, RunSpec, run
from lightning_shard.simulate.table import format_report
from lightning_shard.tools import spawn_ranks


def _child(rank: int, world: int, spec: RunSpec, port: int, out: str) -> None:
    import pickle
    import warnings

    warnings.filterwarnings("ignore")
    result = run(spec)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(result, f)


def run_in_process(spec: RunSpec) -> dict:
    """``spec`` run in a fresh process (forked from one that imported everything once)."""
    return spawn_ranks(_child, 1, spec)[0]


def _specs(args: argparse.Namespace, layers: int) -> list[tuple[str, RunSpec]]:
    base = RunSpec(strategy="ours", model=args.model, layers=layers, seq=args.seq, batch=args.batch, world=args.world,
                   link=args.link, device=args.device, rank=args.rank, network=args.network, per_node=args.per_node,
                   sharing=args.sharing, precision=args.precision, offload=args.offload, prefetch=args.prefetch,
                   steps=args.steps, warmup=args.warmup)
    specs = []
    for strategy in args.strategies:
        specs.append((f"{strategy}", replace(base, strategy=strategy, estimate=strategy == "ours")))
        if not args.no_zero and args.link != "zero":
            specs.append((f"{strategy}@zero", replace(base, strategy=strategy, link="zero")))
    return specs


def main(argv: Optional[list[str]] = None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.simulate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu",
                        help="where this rank runs (default: cuda where there is one)")
    parser.add_argument("--model", nargs="+", choices=tuple(MODELS), default=None,
                        help="; ".join(f"{p.name}: {p.what}" for p in MODELS.values())
                        + " (default: gpt-small on cpu, llama-840m on cuda); several: one report each, in turn")
    parser.add_argument("--world", type=at_least(1), default=8, help="simulated ranks (default: 8)")
    parser.add_argument("--link", choices=NODE_LINKS, default="h100-nvlink",
                        help="; ".join(f"{n}: {LINKS[n].what}" for n in NODE_LINKS) + " (default: h100-nvlink)")
    parser.add_argument("--network", choices=tuple(LINKS), default="ib-ndr",
                        help=f"between nodes ({LINKS['ib-ndr'].what}; default: ib-ndr)")
    parser.add_argument("--per-node", type=at_least(1), default=8, help="ranks per node (default: 8)")
    parser.add_argument("--sharing", choices=SHARING, default="serial",
                        help="serial: one collective at a time on a link, in issue order (default); free: each has the"
                             " whole link")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed",
                        help="bf16-mixed: bf16 parameters and compute, fp32 master weights and reduction (default)")
    parser.add_argument("--offload", choices=OFFLOADS, default="none",
                        help="training state in host memory (FSDP2: params only)")
    parser.add_argument("--prefetch", type=at_least(1), default=1, help="ours: units gathered ahead (default: 1)")
    parser.add_argument("--rank", type=at_least(0), default=0, help="which rank this process is (default: 0)")
    for option, what in (("layers", "blocks to run"), ("seq", "sequence length"), ("batch", "sequences per rank")):
        parser.add_argument(f"--{option}", type=at_least(1), default=None, help=f"{what} (default: the preset's)")
    parser.add_argument("--steps", type=at_least(1), default=None, help="timed steps (default: 3 on cpu, 5 on cuda)")
    parser.add_argument("--warmup", type=at_least(1), default=2, help="steps before timing (default: 2)")
    parser.add_argument("--no-zero", action="store_true", help="skip the zero-cost runs (no exposed figure)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write every run's figures to PATH")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not cuda:
        parser.error(f"--device cuda: no CUDA device here (torch {torch.__version__})")
    if args.rank >= args.world:
        parser.error(f"--rank {args.rank} must be below --world {args.world}")
    if args.offload == "optimizer" and "fsdp2" in args.strategies:
        args.strategies = [s for s in args.strategies if s != "fsdp2"]
        print("FSDP2 left out: it offloads parameters, gradients and optimizer state together (--offload params)")
        if not args.strategies:
            parser.error("--offload optimizer: only ours offloads the optimizer alone")
    models = args.model or (["llama-840m"] if args.device == "cuda" else ["gpt-small"])
    args.steps = args.steps or (5 if args.device == "cuda" else 3)
    reports = []
    for name in dict.fromkeys(models):
        reports.append(_simulate(argparse.Namespace(**{**vars(args), "model": name})))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1, default=str)


def _simulate(args: argparse.Namespace) -> dict:
    """One model's runs and its report (printed)."""
    preset = MODELS[args.model]
    args.seq, args.batch = args.seq or preset.seq, args.batch or preset.batch
    layers = [args.layers or preset.layers]
    if preset.full_layers and args.layers is None:  # two depths, scaled to the whole model (table.py)
        layers = [max(1, preset.layers // 2), preset.layers]
    results: dict[str, list[dict]] = {}
    for depth in layers:
        for name, spec in _specs(args, depth):
            result = run_in_process(spec)
            results.setdefault(name, []).append(result)
            print(f"{preset.name} {name} at {depth} layers: step {result['step']:.4f} s", flush=True)
    header = (f"{preset.name}, world {args.world} on {args.link} ({args.sharing} link), {args.precision},"
              f" offload {args.offload}, sequence {args.seq}, local batch {args.batch}; this rank on"
              f" {_first(results)['device_name']}; torch {torch.__version__}, python {platform.python_version()}")
    print(format_report(results, args, preset, header) + "\n", flush=True)
    return {"header": header, "args": vars(args), "runs": results}


def _first(results: dict[str, list[dict]]) -> dict[str, Any]:
    return next(iter(results.values()))[0]


