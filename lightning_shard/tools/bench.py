"""Benchmark: the same GPT on N gloo ranks under each strategy, runs interleaved, one table.

    python -m lightning_shard.bench                       # 25M-parameter GPT, 2 ranks
    python -m lightning_shard.bench --rounds 5 --steps 6  # more samples

Strategies: each rank alone (a plain loop, no communication), Lightning's ``ddp``, torch FSDP2
(``fully_shard`` per block and on the model, through Lightning's ``ModelParallelStrategy``), and
lightning_shard in each sharding mode. Each *round* runs every strategy once (A B C ... A B C ...) so
that a noisy machine affects all of them alike; medians are taken over all rounds' timed steps.
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import tempfile
import time

import lightning as L
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from lightning_shard.app.callbacks import model_state_bytes
from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.app.models.gpt import GPT
from lightning_shard.app.models.lit_lm import LitLanguageModel

CONFIGS = ("alone", "ddp", "fsdp2", "shard_full", "shard_grad_op", "shard_none")


class BenchLM(LitLanguageModel):
    def __init__(self, model: torch.nn.Module, fsdp2: bool = False) -> None:
        super().__init__(model, lr=1e-3, warmup_steps=1)
        self.fsdp2 = fsdp2

    def configure_model(self) -> None:
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.exposed: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.exposed.append(getattr(trainer.strategy, "comm_stats", {}).get("exposed_seconds", float("nan")))


def _model_state_mb(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    return model_state_bytes(module, [optimizer]) / 2**20


def _strategy(name: str, world: int):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_shard import ShardStrategy

    if name == "ddp":
        return DDPStrategy()
    if name == "fsdp2":
        # the default puts every rank on the tensor-parallel axis: all data-parallel here
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return ShardStrategy(sharding=name.removeprefix("shard_"))


def _data(args, world: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = (args.warmup + args.steps) * args.batch * world
    return DataLoader(torch.randint(0, args.vocab, (n, args.seq + 1), generator=g), batch_size=args.batch)


def _run_alone(args) -> dict:
    torch.manual_seed(0)
    module = BenchLM(GPT(args.vocab, args.width, args.depth, args.heads, args.seq))
    optimizer = module.configure_optimizers()["optimizer"]
    times = []
    for i, batch in enumerate(_data(args, 1)):
        start = time.perf_counter()
        optimizer.zero_grad()
        module._loss(batch).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        if i + 1 == args.warmup + args.steps:
            break
    return {"times": times[args.warmup :], "exposed": [], "state_mb": _model_state_mb(module, optimizer), "comm": {}}


def _run(name: str, args, world: int) -> dict:
    if name == "alone":
        return _run_alone(args)
    torch.manual_seed(0)
    module = BenchLM(GPT(args.vocab, args.width, args.depth, args.heads, args.seq), fsdp2=name == "fsdp2")
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=_strategy(name, world), max_steps=args.warmup + args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(module, _data(args, world))
    comm = dict(getattr(trainer.strategy, "comm_stats", {}))
    return {"times": timer.times[args.warmup :], "exposed": timer.exposed[args.warmup :],
            "state_mb": _model_state_mb(module, trainer.optimizers[0]), "comm": comm}


def _rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank), PYTHONWARNINGS="ignore")
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # one core per rank: ranks must not fight over cores
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    for round_ in range(args.rounds):
        for name in args.configs:  # interleaved: A B C ... A B C ...
            results[name].append(_run(name, args, world))
            if rank == 0:
                print(f"round {round_ + 1}/{args.rounds}: {name} done", flush=True)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)


def _table(results: dict, args, params: int) -> str:
    rows = []
    medians = {name: statistics.median([t for r in runs for t in r["times"]]) for name, runs in results.items()}
    anchor = medians.get("fsdp2")
    header = (f"{'strategy':<15}{'median step s':>14}{'x FSDP2':>9}{'x DDP':>7}{'gathered MB':>13}"
              f"{'reduced MB':>12}{'collectives':>12}{'exposed comm s':>16}{'state MB/rank':>15}")
    rows.append(header)
    rows.append("-" * len(header))
    for name, runs in results.items():
        comm = runs[-1]["comm"]
        exposed = [e for r in runs for e in r["exposed"]]
        reduced = comm.get("reduce_scatter_bytes", 0) + comm.get("all_reduce_bytes", 0)
        rows.append(
            f"{name:<15}{medians[name]:>14.3f}"
            f"{(medians[name] / anchor if anchor else float('nan')):>9.2f}"
            f"{(medians[name] / medians['ddp'] if 'ddp' in medians else float('nan')):>7.2f}"
            f"{(comm['all_gather_bytes'] / 2**20 if comm else float('nan')):>13.1f}"
            f"{(reduced / 2**20 if comm else float('nan')):>12.1f}"
            f"{(comm['collectives'] if comm else float('nan')):>12.0f}"
            f"{(statistics.median(exposed) if exposed and comm else float('nan')):>16.3f}"
            f"{runs[-1]['state_mb']:>15.1f}"
        )
    rows.append(f"\nmodel: GPT, {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MB fp32), depth {args.depth},"
                f" width {args.width}, seq {args.seq}, batch {args.batch}/rank, vocab {args.vocab}")
    rows.append(f"{args.world} gloo ranks, 1 thread each; {args.rounds} rounds x {args.steps} timed steps"
                f" after {args.warmup} warm-up; comm figures are per optimizer step (nan: not measured)")
    rows.append(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; python"
                f" {platform.python_version()}, torch {torch.__version__}, lightning {L.__version__}")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=at_least(1), default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--steps", type=at_least(1), default=4)
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--depth", type=at_least(1), default=6)
    parser.add_argument("--width", type=at_least(1), default=512)
    parser.add_argument("--heads", type=at_least(1), default=8)
    parser.add_argument("--seq", type=at_least(1), default=128)
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--vocab", type=at_least(1), default=12000)
    args = parser.parse_args(argv)
    if args.width % args.heads:  # said here, not in a traceback from every rank
        parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    params = sum(p.numel() for p in GPT(args.vocab, args.width, args.depth, args.heads, args.seq).parameters())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pkl")
        mp.spawn(_rank_main, args=(args.world, args, _free_port(), out), nprocs=args.world, join=True)
        with open(out, "rb") as f:
            results = pickle.load(f)
    print(_table(results, args, params), flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
