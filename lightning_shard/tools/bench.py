"""Benchmark: the same model on N ranks under each strategy, runs interleaved, one table per precision.

    python -m lightning_shard.bench                       # 25M-parameter GPT, 2 gloo CPU ranks
    python -m lightning_shard.bench --rounds 5 --steps 6  # more samples
    python -m lightning_shard.bench --device cuda --precision 32-true bf16-mixed --trace trace.json
    python -m lightning_shard.bench --device cuda --world 1 --model hf-llama --precision bf16-mixed

--model hf-llama: transformers' ``LlamaForCausalLM`` from a config (on cuda by default issue 30's 840M Llama:
16 layers, hidden 2048, 4 KV heads, sequence 1024, batch 4), in place of the repository's GPT.

Strategies: each rank alone (a plain loop, no Lightning, no communication), Lightning with no strategy
(``plain``: one device, world 1 only), Lightning's ``ddp``, torch FSDP2 (``fully_shard`` per block and on
the model, through Lightning's ``ModelParallelStrategy``), and lightning_shard in each sharding mode (``shard_hybrid``: not by default; its shard groups are
``--shard-size`` ranks, default half the world; ``shard_offload_optimizer`` and ``shard_offload_params``: ``full``
with the training state in host memory, not by default either). Each
*round* runs every strategy once (A B C ... A B C ...) so that a noisy machine affects all of them alike;
medians are taken over all rounds' timed steps.

Default strategies: at --world 1 alone, plain, fsdp2 and lightning_shard's modes (ddp has nothing to compare
there); at --world 2 or more alone, ddp, fsdp2 and lightning_shard's modes. At --world 1 each run (a strategy in a
round) is a fresh process, so that no run inherits another's allocator or caches (``--same-process``: one process).

--device cuda: NCCL (Lightning picks it), one GPU per rank, --world defaults to the GPUs there are, and a
larger model (depth 12, width 1024, seq 512, vocab 32000: 184M parameters). Step times are taken between
torch.cuda.synchronize() calls; the table adds each rank's peak of torch.cuda.max_memory_allocated() (the
largest rank's) next to lightning_shard's own estimates.

--optimizer adamw muon: one table per optimizer too. ``muon``: torch's Muon for the blocks' matrices and AdamW
for the rest (embeddings, norms, biases), as torch's docs advise; two optimizers, so manual optimization. FSDP2
is left out there: Muon on its DTensor shards is not the same optimizer.

--compile: each chosen config also runs with every transformer block compiled (``NAME_compiled``): ``block.compile()``
for alone, plain, ddp and fsdp2 (before ``fully_shard``, as torchtitan does), ``ShardStrategy(compile=True)`` for
lightning_shard. Compilation happens in the warm-up steps (cached on disk by inductor after the first run).

--trace PATH: after the rounds, shard_full runs once more (the first --precision) and rank 0 records 3 steps
after warm-up with torch.profiler (CPU, and CUDA on cuda) into a Chrome trace at PATH (chrome://tracing or
https://ui.perfetto.dev): on a GPU, the next unit's all-gather on its own stream under this unit's compute.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import statistics
import time
from contextlib import nullcontext

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_shard.app.callbacks import model_state_bytes
from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.tools import spawn_ranks
from lightning_shard.tools.bench_models import DEFAULTS, MODELS, BenchLM, build_model, compile_blocks
from lightning_shard.tools.bench_probes import HostPeak, ProfileSteps, StepTimer, sync
from lightning_shard.tools.bench_table import COMPILED, format_table, merge_ranks

EAGER_CONFIGS = ("alone", "plain", "ddp", "fsdp2", "shard_full", "shard_grad_op", "shard_hybrid", "shard_none",
                 "shard_offload_optimizer", "shard_offload_params")
CONFIGS = EAGER_CONFIGS + tuple(name + COMPILED for name in EAGER_CONFIGS)
PRECISIONS = ("32-true", "bf16-mixed")
OPTIMIZERS = ("adamw", "muon")
TRACE_STEPS = 3


def default_configs(world: int) -> list[str]:
    if world == 1:
        return ["alone", "plain", "fsdp2", "shard_full", "shard_grad_op", "shard_none"]
    return ["alone", "ddp", "fsdp2", "shard_full", "shard_grad_op", "shard_none"]


def _model_state_mb(module: torch.nn.Module, optimizers: list) -> float:
    return model_state_bytes(module, optimizers) / 2**20


def _strategy(name: str, world: int, compiled: bool = False, shard_size: int | None = None):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_shard import ShardStrategy

    if name == "plain":
        return "auto"  # Lightning's own single-device strategy
    if name == "ddp":
        return DDPStrategy()
    if name == "fsdp2":
        # the default puts every rank on the tensor-parallel axis: all data-parallel here
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if name.startswith("shard_offload_"):  # full sharding, training state in host memory
        return ShardStrategy(offload=name.removeprefix("shard_offload_"), compile=compiled)
    sharding = name.removeprefix("shard_")
    return ShardStrategy(sharding=sharding, compile=compiled, shard_size=shard_size if sharding == "hybrid" else None)


def _data(args, world: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = (args.warmup + args.steps) * args.batch * world
    return DataLoader(torch.randint(0, args.vocab, (n, args.seq + 1), generator=g), batch_size=args.batch)


def _run_alone(args, precision: str, optimizer_name: str, compiled: bool = False) -> dict:
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    module = BenchLM(build_model(args), optimizer=optimizer_name).to(device)
    if compiled:
        compile_blocks(module.model)
    configured = module.configure_optimizers()
    optimizers = [configured["optimizer"]] if isinstance(configured, dict) else configured
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
    times = []
    for i, batch in enumerate(_data(args, 1)):
        batch = batch.to(device)
        sync(cuda)
        start = time.perf_counter()
        for optimizer in optimizers:
            optimizer.zero_grad()
        with autocast:
            loss = module._loss(batch)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        sync(cuda)
        times.append(time.perf_counter() - start)
        if i + 1 == args.warmup + args.steps:
            break
    return {"times": times[args.warmup :], "exposed": [], "state_mb": _model_state_mb(module, optimizers), "comm": {}}


def _run(name: str, args, world: int, precision: str, rank: int = 0, trace: str | None = None,
         optimizer: str = "adamw") -> dict:
    """One run of one strategy; on cuda also its peak memory and lightning_shard's estimate. With ``trace``, fewer
    steps on every rank (they must agree) and rank 0 records them."""
    cuda = args.device == "cuda"
    if cuda:  # earlier runs' tensors are gone before this one's peak is measured
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    host = HostPeak()
    host.start()
    compiled = name.endswith(COMPILED)
    name = name.removesuffix(COMPILED)
    if name == "alone":
        result = _run_alone(args, precision, optimizer, compiled)
        estimate = None
    else:
        torch.manual_seed(0)
        module = BenchLM(build_model(args), fsdp2=name == "fsdp2", optimizer=optimizer,
                         compile_blocks=compiled and not name.startswith("shard_"))
        timer = StepTimer(cuda)
        callbacks: list[L.Callback] = [timer]
        steps = args.warmup + args.steps
        if trace is not None:
            steps = args.warmup + min(TRACE_STEPS, args.steps)
            if rank == 0:
                callbacks.append(ProfileSteps(args.warmup, steps - args.warmup, cuda, trace=trace))
        trainer = L.Trainer(
            accelerator=args.device, devices=1 if name == "plain" else world, strategy=_strategy(name, world, compiled, args.shard_size),
            precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        )
        trainer.fit(module, _data(args, world))
        comm = dict(getattr(trainer.strategy, "comm_stats", {}))
        estimate = getattr(trainer.strategy, "memory_estimate", None)
        result = {"times": timer.times[args.warmup :], "exposed": timer.exposed[args.warmup :],
                  "state_mb": _model_state_mb(module, trainer.optimizers), "comm": comm}
    result["host_mb"] = host.growth_mb()
    result["host_estimate_mb"] = estimate.host / 2**20 if estimate is not None else float("nan")
    if cuda:
        result["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        result["base_mb"] = base / 2**20
        result["estimate_mb"] = estimate.peak / 2**20 if estimate is not None else float("nan")
    return result


def _estimate_with_activations(name: str, args, world: int, precision: str) -> float:
    """lightning_shard's estimate with one batch's activations (as ``python -m lightning_shard.estimate``), MiB."""
    from lightning_shard.lightning.precision import ShardPrecision
    from lightning_shard.memory.estimate import estimate_memory

    with torch.device("meta"):
        module = BenchLM(build_model(args))
    offload = name.removeprefix("shard_offload_") if name.startswith("shard_offload_") else None
    estimate = estimate_memory(
        module, world, sharding="full" if offload else name.removeprefix("shard_"), offload=offload,
        param_dtype=ShardPrecision(precision).policy.param_dtype, autocast=ShardPrecision(precision).autocast_dtype,
        cast_params=ShardPrecision(precision).policy.cast_params,
        zero_grad_before_backward=False,  # the strategy frees them after each step
        optimizer=torch.optim.AdamW, step=lambda m, b: m._loss(b), batch=next(iter(_data(args, world))),
        device=args.device, shard_size=args.shard_size if name == "shard_hybrid" else None,
    )
    return estimate.peak / 2**20


def _rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank), PYTHONWARNINGS="ignore")
    import warnings

    warnings.filterwarnings("ignore")
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # one core per rank: ranks must not fight over cores
    tables = [(p, o) for p in args.precision for o in args.optimizer]
    results: dict[tuple[str, str], dict[str, list[dict]]] = {
        t: {c: [] for c in args.configs if t[1] == "adamw" or not c.startswith("fsdp2")} for t in tables}
    estimates: dict[tuple[str, str], float] = {}
    errors: list[str] = []
    for round_ in range(args.rounds):
        for precision, optimizer in tables:
            for name in results[precision, optimizer]:  # interleaved: A B C ... A B C ...
                results[precision, optimizer][name].append(_run(name, args, world, precision, rank, optimizer=optimizer))
                if (args.device == "cuda" and rank == 0 and name.startswith("shard_") and round_ == 0 and args.first_round
                        and optimizer == "adamw" and not name.endswith(COMPILED)):
                    try:  # once per config, after its run (the other ranks wait in the next setup, untimed)
                        estimates[precision, name] = _estimate_with_activations(name, args, world, precision)
                    except Exception as err:  # an estimate must not stop the benchmark
                        estimates[precision, name] = float("nan")
                        errors.append(f"{name} {precision}: no estimate with activations ({type(err).__name__}: {err})")
                if rank == 0:  # with its median: a run stopped before the table still says what it measured
                    times = results[precision, optimizer][name][-1]["times"]
                    median = f"{statistics.median(times):.4f} s" if times else "no step timed"
                    print(f"round {round_ + 1 + args.round_offset}/{args.rounds + args.round_offset}: {name} {precision}"
                          f" {optimizer} done (median step on rank 0: {median})", flush=True)
    if args.trace:
        _run("shard_full", args, world, args.precision[0], rank, trace=args.trace)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"results": results, "estimates": estimates, "errors": errors}, f)


def _spawn(args) -> list[dict]:
    """``args.world`` rank processes running ``args``' rounds; what each rank returned."""
    return spawn_ranks(_rank_main, args.world, args)


def _spawn_per_run(args) -> list[dict]:
    """Each run (a configuration, precision and optimizer in one round) in fresh processes, interleaved as in one
    process: no run follows another in the same process (on a GPU, a run after another was up to 30 ms a step slower)."""
    merged: list[dict] = [{"results": {}, "estimates": {}, "errors": []} for _ in range(args.world)]
    for round_ in range(args.rounds):
        for precision in args.precision:
            for optimizer in args.optimizer:
                for name in args.configs:
                    if optimizer != "adamw" and name.startswith("fsdp2"):
                        continue
                    one = argparse.Namespace(**{**vars(args), "rounds": 1, "precision": [precision], "trace": None,
                                                "optimizer": [optimizer], "configs": [name], "round_offset": round_,
                                                "first_round": round_ == 0})
                    for into, part in zip(merged, _spawn(one)):
                        for table, configs in part["results"].items():
                            for config, runs in configs.items():
                                into["results"].setdefault(table, {}).setdefault(config, []).extend(runs)
                        into["estimates"].update(part["estimates"])
                        into["errors"] += part["errors"]
    if args.trace:
        _spawn(argparse.Namespace(**{**vars(args), "rounds": 0}))
    return merged


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.bench", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="gpt",
                        help="gpt: the repository's GPT; hf-llama: transformers' LlamaForCausalLM from a config, GQA"
                             " with a quarter of the heads for keys and values (default: gpt)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo ranks, 1 thread each; cuda: NCCL, one GPU per rank (default: cpu)")
    parser.add_argument("--world", type=at_least(1), default=None,
                        help="ranks (default: 2 on cpu, the number of GPUs on cuda)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                        help="strategies (default: alone, plain and the shard modes at --world 1; alone, ddp, fsdp2"
                             " and the shard modes otherwise; plain runs at --world 1 only)")
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["32-true"],
                        help="one table per precision, runs interleaved (default: 32-true)")
    parser.add_argument("--optimizer", nargs="+", choices=OPTIMIZERS, default=["adamw"],
                        help="one table per optimizer (default: adamw); muon: Muon for the blocks' matrices, AdamW"
                             " for the rest")
    parser.add_argument("--compile", action="store_true",
                        help="also run each chosen config with its transformer blocks compiled (NAME_compiled)")
    parser.add_argument("--trace", metavar="PATH", default=None,
                        help="also write a Chrome trace of shard_full's steps on rank 0 to PATH (a .json file)")
    parser.add_argument("--shard-size", type=at_least(1), default=None,
                        help="shard_hybrid's shard_size (default: half the world: two replicas of a full shard group)")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--same-process", action="store_true",
                        help="at --world 1, run every configuration in one process (default: each run in a fresh one)")
    for option in ("steps", "warmup", "depth", "width", "heads", "seq", "batch", "vocab"):
        low = 0 if option == "warmup" else 1
        parser.add_argument(f"--{option}", type=at_least(low), default=None,
                            help=f"default: {DEFAULTS['gpt', 'cpu'][option]} on cpu, {DEFAULTS['gpt', 'cuda'][option]}"
                                 f" on cuda (hf-llama: {DEFAULTS['hf-llama', 'cpu'][option]},"
                                 f" {DEFAULTS['hf-llama', 'cuda'][option]})")
    args = parser.parse_args(argv)
    for option, value in DEFAULTS[args.model, args.device].items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    if args.device == "cuda":  # said here, in one line, not in a traceback from every rank
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
            parser.error(f"--device cuda: no CUDA device here (torch.cuda.is_available() is False; torch"
                         f" {torch.__version__} is {build})")
        gpus = torch.cuda.device_count()
        args.world = gpus if args.world is None else args.world
        if args.world > gpus:
            parser.error(f"--world {args.world} on cuda needs {args.world} GPUs, one per rank; there are {gpus}")
    elif args.world is None:
        args.world = 2
    args.configs = list(dict.fromkeys(args.configs or default_configs(args.world)))
    if any(c.startswith("shard_hybrid") for c in args.configs):
        args.shard_size = args.shard_size or max(args.world // 2, 1)
        if args.world % args.shard_size:
            parser.error(f"--shard-size {args.shard_size} does not divide --world {args.world}")
    if args.compile:
        args.configs = list(dict.fromkeys(args.configs + [c + COMPILED for c in args.configs if not c.endswith(COMPILED)]))
    args.precision = list(dict.fromkeys(args.precision))
    args.optimizer = list(dict.fromkeys(args.optimizer))
    if any(c.removesuffix(COMPILED) == "plain" for c in args.configs) and args.world != 1:
        parser.error(f"plain (Lightning with no strategy) runs on one device: use --world 1, not {args.world}")
    if args.width % args.heads:
        parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if args.trace:
        args.trace = os.path.abspath(args.trace)
        if os.path.isdir(args.trace) or not os.path.isdir(os.path.dirname(args.trace)):
            parser.error(f"--trace {args.trace}: must be a file path in an existing folder")
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(args).parameters())
    args.first_round, args.round_offset = True, 0
    if args.world == 1 and not args.same_process:
        ranks = _spawn_per_run(args)
    else:
        ranks = _spawn(args)
    merged = merge_ranks(ranks)
    tables = [format_table(merged["results"][p, o], args, params, p, merged["estimates"], o)
              for p in args.precision for o in args.optimizer]
    print("\n\n".join(tables), flush=True)
    for error in merged["errors"]:
        print(error, flush=True)
    if args.trace:
        print(f"trace: {min(TRACE_STEPS, args.steps)} shard_full steps ({args.precision[0]}) on rank 0 after"
              f" {args.warmup} warm-up written to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)",
              flush=True)
