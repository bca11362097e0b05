"""Checkpoint benchmark: how long a save blocks training, how long until it is complete, the host memory it holds,
and load times; lightning_shard (sharded, sharded in the background, full) against torch FSDP2 + DCP (``dcp.save`` and
``dcp.async_save``), in one run.

    python -m lightning_shard.tools.bench_checkpoint [--world 2] [--depth 6] [--width 512] [--rounds 3] [--saves 3]
    python -m lightning_shard.tools.bench_checkpoint --depth 8 --width 2048 --heads 16 --rounds 2 \
        --configs sharded sharded_async fsdp2 fsdp2_async                      # 420M parameters, 4.8 GB of state
    python -m lightning_shard.tools.bench_checkpoint --device cuda --model hf-llama   # issue 30's 840M Llama, one GPU

A model with AdamW state after one step, on ``--world`` ranks (gloo on CPU, one thread each; one GPU a rank on cuda).
Each configuration saves ``--saves`` times in a row, then loads once. Per save: **blocked**, the time the call takes
(the most of any rank; on cuda until the device is done with it: a background save's copies out of device memory
included), and **to completion**, from the call until the checkpoint is complete on disk (a synchronous save: the
same). A background save is waited for before the next; the first save is given apart (it builds what later saves
reuse; ours copies into the host memory the strategy reserves, and touches, at setup: reserved here as it would be,
and touched before the first save, as it is in a run whose setup was steps before). Host memory, the most of any rank: what a background save copies to host memory
(the tensors' bytes), what of it is kept between saves, and the peak resident-set growth during the saves above the
level before the first (sampled every 2 ms; memory a step freed is reused, so it can be less than the copy). Every
figure is a median over rounds (and over the saves after the first).

FSDP2 + DCP saves through ``get_state_dict`` and ``dcp.save`` / ``dcp.async_save`` (its default stager, as a user calls
it), the background one over a gloo process group of its own, as torch advises (its collectives must not meet
training's).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_shard.tools import spawn_ranks
from lightning_shard.tools.bench_models import DEFAULTS, MODELS, build_model

CONFIGS = ("sharded", "sharded_async", "full", "fsdp2", "fsdp2_async")
LABELS = {"sharded": "lightning_shard `sharded`", "sharded_async": "lightning_shard `sharded`, `async_save`",
          "full": "lightning_shard `full`", "fsdp2": "torch FSDP2 + DCP `save`",
          "fsdp2_async": "torch FSDP2 + DCP `async_save`"}


class PeakRSS:
    """Peak resident memory above the level at entry, in MiB (``growth_mb``, so far while inside); ``held_mb``: the
    level at exit above the entry's."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    @property
    def growth_mb(self) -> float:
        return (max(self.peak, self._rss()) - self.start) / 2**20

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.held_mb = (self._rss() - self.start) / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device(args) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def _sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def _trained(args, fsdp2: bool = False):
    """The model sharded, with AdamW's state after one step (gradients freed)."""
    torch.manual_seed(0)
    model = build_model(args).to(_device(args))
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(args.device, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runtime = None
    else:
        from lightning_shard.engine.shard_module import shard_module

        runtime = shard_module(model, units=[type(model.blocks[0])], device=_device(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if runtime is not None:
        runtime.attach_optimizer(optimizer)
    idx = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(idx.to(_device(args))).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(args)
    return model, runtime, optimizer


def _most(value: float) -> float:
    """The largest of the ranks' values."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_host_group())
    return tensor.item()


_GROUP: list = []


def _host_group() -> dist.ProcessGroup:
    """A gloo group for the benchmark's own figures (the default group may be NCCL)."""
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def _measured_saves(args, save: Callable[[], Optional[Callable[[], float]]]) -> dict[str, Any]:
    """``save()`` starts a save and returns, for a save in the background, a function waiting for it and giving its
    seconds from the call to completion. Per save: blocked s, to completion s; the host memory above the level before
    the first save: its peak during the saves, and what is held once the last is complete (MB)."""
    figures = []
    with PeakRSS() as memory:
        for _ in range(args.saves):
            dist.barrier(group=_host_group())
            start = time.perf_counter()
            wait = save()
            _sync(args)  # (the device copies of a background save: the device is not free before)
            blocked = time.perf_counter() - start
            completion = wait() if wait is not None else blocked
            figures.append({"blocked": _most(blocked), "completion": _most(completion)})
    return {"saves": figures, "peak_mb": _most(memory.growth_mb), "held_mb": _most(memory.held_mb)}


def _timed_load(args, load: Callable[[], None]) -> dict[str, float]:
    dist.barrier(group=_host_group())
    with PeakRSS() as memory:
        start = time.perf_counter()
        load()
        _sync(args)
        seconds = time.perf_counter() - start
    return {"load": _most(seconds), "load_growth_mb": _most(memory.growth_mb)}


def _ours(args, directory: Path, kind: str) -> dict[str, Any]:
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_shard.checkpoint import sharded
    from lightning_shard.checkpoint.async_save import AsyncSaver
    from lightning_shard.checkpoint.full import (
        full_optimizer_state_dict,
        full_state_dict,
        load_full_optimizer_state_dict,
        load_full_state_dict,
    )
    from lightning_shard.checkpoint.io import open_checkpoint, save_full, save_sharded

    model, runtime, optimizer = _trained(args)
    path = directory / f"{kind}.ckpt"
    saver = AsyncSaver(timeout=timedelta(seconds=1800), device=_device(args)) if kind == "sharded_async" else None
    if saver is not None:  # as the strategy sets it up: the staging memory reserved (and touched) at setup
        from lightning_shard.memory.estimate import estimate_sharded

        saver.setup()
        staging = estimate_sharded(runtime, "full", 1, torch.optim.AdamW, async_save=True).checkpoint_staging
        saver.stager.reserve(staging, _device(args))
        saver.stager.wait_reserved()  # (a run's first save comes steps after its setup)

    def sharded_state() -> dict[str, Any]:
        return {"state_dict": sharded.model_state(runtime),
                "optimizer_states": [sharded.optimizer_state(runtime, optimizer)]}

    def save() -> Optional[Callable[[], float]]:
        if kind == "sharded":
            save_sharded(sharded_state(), path)
        elif saver is not None:
            saver.save(sharded_state(), path)
            return lambda: (saver.complete(), saver.last_seconds)[1]
        else:
            checkpoint = {"state_dict": full_state_dict(runtime),
                          "optimizer_states": [full_optimizer_state_dict(runtime, optimizer)]}
            if dist.get_rank() == 0:
                save_full(checkpoint, path, TorchCheckpointIO())
        return None

    def load() -> None:
        checkpoint = open_checkpoint(path)
        source = checkpoint["state_dict"]
        if kind == "full":
            load_full_state_dict(runtime, source)
            load_full_optimizer_state_dict(runtime, optimizer, checkpoint["optimizer_states"][0])
        else:
            sharded.load_model_state(runtime, source.directory, source.metadata)
            sharded.load_optimizer_state(runtime, optimizer, 0, checkpoint["optimizer_states"][0],
                                         source.directory, source.metadata)

    figures = {**_measured_saves(args, save), **_timed_load(args, load)}
    if saver is not None:  # copied at each save into host memory kept for the next
        figures["staged_mb"] = _most(saver.stager.copied_bytes / 2**20)
        figures["kept_mb"] = _most(saver.held_bytes / 2**20)
        saver.close()
    return figures


def _fsdp2(args, directory: Path, background: bool, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, _, optimizer = _trained(args, fsdp2=True)
    path = str(directory / ("fsdp2_async" if background else "fsdp2"))
    staged: list[float] = []

    def save() -> Optional[Callable[[], float]]:
        start = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        if not background:
            dcp.save(state, checkpoint_id=path)
            return None
        local = [getattr(t, "_local_tensor", t) for t in _tensors(state)]
        staged.append(sum(t.untyped_storage().nbytes() for t in {id(t): t for t in local}.values()) / 2**20)
        future = dcp.async_save(state, checkpoint_id=path, process_group=group)
        done: list[float] = []
        future.add_done_callback(lambda _: done.append(time.perf_counter() - start))

        def wait() -> float:
            future.result()
            while not done:  # (the callback runs just after the result is set)
                time.sleep(0.001)
            return done[0]

        return wait

    def load() -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    figures = {**_measured_saves(args, save), **_timed_load(args, load)}
    if background:  # DCP's default stager copies each tensor's storage, into memory allocated for that save
        figures["staged_mb"], figures["kept_mb"] = _most(max(staged)), 0.0
    return figures


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _tensors(value)]
    return [state] if isinstance(state, torch.Tensor) else []


def _rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    import pickle
    import warnings

    warnings.filterwarnings("ignore")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    backend = "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    directory = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)) if rank == 0 else None
    holder = [str(directory)]
    dist.broadcast_object_list(holder, group=_host_group())
    directory = Path(holder[0])
    background_group = dist.new_group(backend="gloo")  # FSDP2's async_save: a group of its own
    results: dict[str, list] = {name: [] for name in args.configs}
    for round_ in range(args.rounds):
        for name in args.configs:
            if name == "fsdp2" or name == "fsdp2_async":
                figures = _fsdp2(args, directory, name == "fsdp2_async", background_group)
            else:
                figures = _ours(args, directory, name)
            results[name].append(figures)
            if rank == 0:
                print(f"round {round_} {name}: blocked {[round(s['blocked'], 3) for s in figures['saves']]} s,"
                      f" to completion {[round(s['completion'], 3) for s in figures['saves']]} s,"
                      f" load {figures['load']:.2f} s", flush=True)
                for leftover in directory.iterdir():  # the next configuration's disk and page cache start alike
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            dist.barrier(group=_host_group())
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(results if rank == 0 else None, f)
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    dist.barrier(group=_host_group())
    dist.destroy_process_group()


def blocked(runs: list) -> float:
    """The median blocked time of the saves after the first (of the only one, with ``--saves 1``)."""
    return statistics.median(s["blocked"] for r in runs for i, s in enumerate(r["saves"])
                             if i > 0 or len(r["saves"]) == 1)


def table(results: dict[str, list]) -> str:
    """The markdown table of medians (see the module note)."""

    def med(runs: list, pick: Callable[[dict], float], first: Optional[bool] = None) -> float:
        values = [pick(s) for r in runs for i, s in enumerate(r["saves"])
                  if first is None or (i == 0) == first or len(r["saves"]) == 1]
        return statistics.median(values)

    base = med(results["sharded"], lambda s: s["blocked"], False) if "sharded" in results else None
    rows = ["| checkpoint | blocked s, first save | blocked s, later saves | x our sync save | to completion s |"
            " copied to host MB | kept between saves MB | resident peak MB | load s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        blocked = med(runs, lambda s: s["blocked"], False)
        ratio = f"{blocked / base:.3f}" if base else "-"
        rows.append(f"| {LABELS[name]} | {med(runs, lambda s: s['blocked'], True):.3f} | {blocked:.3f} | {ratio} |"
                    f" {med(runs, lambda s: s['completion'], False):.2f} |"
                    f" {statistics.median(r.get('staged_mb', 0.0) for r in runs):.0f} |"
                    f" {statistics.median(r.get('kept_mb', 0.0) for r in runs):.0f} |"
                    f" {statistics.median(r['peak_mb'] for r in runs):.0f} |"
                    f" {statistics.median(r['load'] for r in runs):.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=3, help="saves in a row per configuration and round")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: 1 on cpu)")
    parser.add_argument("--max-blocked", nargs="*", default=[], metavar="CONFIG=SECONDS",
                        help="exit 1 if a configuration's blocked time per save (later saves) is above SECONDS")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    args = parser.parse_args()
    defaults = {"vocab": 8192, "width": 512, "depth": 6, "heads": 8, "seq": 128} if args.model == "gpt" \
        and args.device == "cpu" else DEFAULTS[(args.model, args.device)]
    for key in ("vocab", "width", "depth", "heads", "seq"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.world is None:
        args.world = 1 if args.device == "cuda" else 2
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    limits = {}
    for item in args.max_blocked:
        name, _, seconds = item.partition("=")
        if name not in args.configs or not seconds:
            parser.error(f"--max-blocked takes CONFIG=SECONDS for a configuration that runs, got {item!r}")
        limits[name] = float(seconds)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(args).parameters())
    results = spawn_ranks(_rank_main, args.world, args)[0]
    state_mb = n_params * 4 * 3 / 2**20  # weights + Adam's two moments, fp32
    print(f"\n{args.model} {n_params / 1e6:.1f}M parameters; weights + optimizer state {state_mb:.0f} MB;"
          f" {args.world} {'gloo ranks' if args.device == 'cpu' else 'GPU(s)'}; {args.saves} saves in a row;"
          f" medians of {args.rounds} rounds\n")
    print(table(results))
    over = [f"{name}: {blocked(results[name]):.3f} s > {limit} s" for name, limit in limits.items()
            if blocked(results[name]) > limit]
    if over:
        raise SystemExit("blocked time per save above its bound: " + "; ".join(over))


if __name__ == "__main__":
    main()
