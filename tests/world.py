"""Run a function on a real multi-process gloo world, with a hard timeout: a hang fails, never stalls.

Ranks are forked from a server process that imported torch, Lightning, lightning_shard (and transformers and peft
where installed) once: a rank starts in a fraction of a second instead of re-importing them, which cost seconds per
rank on 2 cores (most of the suite's time). Nothing there starts a thread or touches a GPU before the fork. Each rank
gets the environment the test process has when the world starts, as a spawned rank would.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import socket
import tempfile
import traceback
from datetime import timedelta
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_PRELOAD = ["torch", "torch.distributed", "lightning", "lightning_shard", "transformers", "peft"]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload([m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
            pg_timeout: float, environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"result{rank}"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = 240, pg_timeout: float = 60,
              may_die: tuple[int, ...] = ()) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank results or raise.

    Ranks in ``may_die`` may be killed (their result is None); every other rank must return.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [
            _CONTEXT.Process(target=_worker, args=(r, world_size, port, out_dir, fn, args, pg_timeout, dict(os.environ)),
                             daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"error{r}")
            if os.path.exists(path):
                errors.append(f"--- rank {r} ---\n{open(path).read()}")
        if errors:
            raise AssertionError("\n".join(errors))
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout}s")
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0 and r not in may_die]
        if bad:
            raise AssertionError(f"ranks exited with non-zero codes: {bad}")
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"result{r}")
            if r in may_die and not os.path.exists(path):
                results.append(None)
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results


def scenarios_passed(results: list[dict[str, dict]]) -> dict[str, dict]:
    """A world of named scenarios (each rank's ``{name: result}``, a failed one's result ``{"error": text}``): rank 0's
    results, or an AssertionError with every rank's errors."""
    failed = {name: result["error"] for name, result in results[0].items() if "error" in result}
    for rank, answers in enumerate(results[1:], start=1):
        failed.update({f"{name} (rank {rank})": result["error"] for name, result in answers.items()
                       if "error" in result and name not in failed})
    assert not failed, "\n\n".join(f"--- {name}\n{error}" for name, error in failed.items())
    return results[0]


@contextmanager
def one_rank_here() -> Iterator[None]:
    """Trainers with ``devices=1`` run in this process: quiet, and the process group they start destroyed after, so
    that the next test (or world) starts without one."""
    initialized = dist.is_initialized()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if dist.is_initialized() and not initialized:
            dist.destroy_process_group()


def as_lightning_rank(rank: int, world: int) -> None:
    """This world's processes are a Trainer's ranks: without LOCAL_RANK, Lightning's launcher would start the other
    ranks itself by re-running this process's command line (the whole pytest run)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))


def leave_lightning_app(results: dict, out: str) -> None:
    """The end of a Lightning app the tests run as a script (its Trainers relaunch it for the other ranks): rank 0 of
    node 0 saves ``results`` for the test; then the group Lightning's DDPStrategy created is destroyed, not left to
    interpreter shutdown, where gloo's threads may abort the process ("terminate called without an active
    exception", seen once on node 1 of a 2-node run)."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
