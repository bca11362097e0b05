"""Sharded checkpoints written in the background: a save copies each rank's tensors to host memory and returns; the
files are written while training goes on.

A save (every rank calls :meth:`AsyncSaver.save`, as it would ``save_sharded``):

1. waits for the save still in flight, if any (at most one is), and raises on every rank if it failed on any;
2. rank 0 creates ``PATH.partial``, as a synchronous save does; the tensors are copied into host memory kept across
   saves (``staging.HostStager``) and the rest of the checkpoint (loops, schedulers, callbacks: what goes into
   ``meta.pt``) is serialised, so that what is written is the state at this save, whatever training changes later;
   it returns;
3. in a thread of its own, over a gloo process group of its own (so that its collectives never meet training's):
   ``dcp.save`` writes the files, as a synchronous save does, then exactly what that does after its writes
   (``io.commit_sharded``): every rank's checksums, ``meta.pt``, the manifest and the atomic move into place.
   Checkpoint removals asked for while it is in flight (``ModelCheckpoint`` rotating its top-k) wait until it has
   committed, and are dropped if it fails: the checkpoint they would leave as the newest stays.

This is what ``dcp.async_save`` does (a stager, then ``dcp.save`` in a thread), without calling it: ``async_save``
wraps each item's ``state_dict()`` in its logger on the calling thread (0.2 s of blocked time for a 23M GPT's 300
items), and leaves no place for the commit that must follow the writes.

A failure there (a write error, a rank killed) leaves ``PATH.partial`` without a manifest and any previous checkpoint
at ``PATH`` untouched, as a failed synchronous save does. It is raised on every rank at the next of: the next save,
the next training step's first agreement (:meth:`failed` rides on it, engine/runtime/reduce.py), or :meth:`complete`
(the strategy's teardown: a fit returns only once its last save is complete), naming the checkpoint.
"""

from __future__ import annotations

import io
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as StillRunning
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from lightning_shard.checkpoint import files, staging
from lightning_shard.checkpoint.io import RankFailures, all_succeed, commit_sharded, split_checkpoint
from lightning_shard.engine.comm.collectives import from_every_rank


class StagedWriter(FileSystemWriter):
    """DCP's file writer, as a synchronous save configures it, that first waits for the staging copies to land."""

    def __init__(self, directory: Path, landed: Callable[[], None]) -> None:
        super().__init__(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1)
        self._landed = landed

    def write_data(self, plan: Any, planner: Any) -> Any:
        self._landed()
        return super().write_data(plan, planner)


@dataclass
class _InFlight:
    """One save on its way: done when committed, or failed (its exception)."""

    path: Path
    started: float
    done: Future = field(default_factory=Future)
    removals: list[Callable[[], None]] = field(default_factory=list)  # asked for meanwhile: run once committed
    committed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    seconds: Optional[float] = None  # from the save's call to its commit

    def error(self, timeout: Optional[float] = None) -> Optional[str]:
        """This rank's failure, after waiting for the save to end here (None: committed, or still running after
        ``timeout`` seconds)."""
        try:
            self.done.result(timeout=timeout)
        except StillRunning:  # (concurrent.futures' own class before Python 3.11)
            return None
        except RankFailures as err:  # agreed by the ranks: it names each one's failure
            return str(err)
        except BaseException as err:  # noqa: BLE001 - named to every rank
            return f"rank {dist.get_rank()}: {type(err).__name__}: {err}"
        return None


class AsyncSaver:
    """Sharded saves of one training run written in the background (see the module note). Every rank creates one and
    calls :meth:`setup`, :meth:`save` and :meth:`complete` at the same points. ``timeout``: the bound on the collectives
    of its own process group (a dead peer turns into an error within it); ``device``: the rank's (a GPU: the writing
    thread's current device, where DCP's writer makes its stream)."""

    def __init__(self, timeout: Optional[timedelta] = None, device: Optional[torch.device] = None) -> None:
        self.timeout = timeout
        self.device = device
        self.group: Optional[dist.ProcessGroup] = None
        self.stager = staging.HostStager()
        self._writer: Optional[ThreadPoolExecutor] = None  # one thread, for the saves' lifetime
        self._inflight: Optional[_InFlight] = None
        self.last_seconds: Optional[float] = None  # the last completed save's time from call to commit

    def setup(self) -> None:
        """Create the process group the background writes use (every rank, at the same point)."""
        if self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_shard_checkpoint")

    @property
    def open(self) -> bool:
        """Between :meth:`setup` and :meth:`close`: saves may go to the background."""
        return self._writer is not None

    @property
    def in_flight(self) -> Optional[Path]:
        """The checkpoint being written, if any (until :meth:`complete` confirms it)."""
        return self._inflight.path if self._inflight is not None else None

    def writing(self, path: Any) -> bool:
        """Whether ``path`` is the checkpoint in flight (written, or committed and not yet confirmed): to a
        ``ModelCheckpoint`` deciding a file name, it exists."""
        return self._inflight is not None and os.path.abspath(path) == os.path.abspath(self._inflight.path)

    @property
    def held_bytes(self) -> int:
        """Host memory kept for staging between saves."""
        return self.stager.held_bytes

    def save(self, checkpoint: dict[str, Any], path: Path, group: Optional[dist.ProcessGroup] = None) -> None:
        """Start saving ``checkpoint`` (as built for ``save_sharded``) to ``path``; returns once it is staged.
        ``group``: the ranks' group for this call's own agreements (the default group)."""
        self.setup()
        self.complete(group)  # at most one in flight: the previous one, committed or raised on every rank
        rank = dist.get_rank(group)
        inflight = _InFlight(path, time.perf_counter())
        items = split_checkpoint(checkpoint)
        meta = io.BytesIO()
        staged: list[dict[str, Any]] = []

        def prepare() -> None:
            if rank == 0:
                files.begin(path)
            torch.save(checkpoint, meta)  # now: callbacks hand in their live state (ModelCheckpoint's best_k_models)
            staged.append(self.stager.copy(items))

        try:  # a failure here on any rank (host memory, a path rank 0 cannot create) stops every rank's save
            all_succeed(prepare, group)
        except Exception as err:
            raise OSError(f"lightning_shard: saving the checkpoint {str(path)!r} failed ({err}); any previous"
                          " checkpoint at that path is intact.") from err
        assert self._writer is not None
        self._inflight = inflight
        self._writer.submit(self._write, staged[0], inflight, meta.getvalue())

    def _write(self, staged: dict[str, Any], inflight: _InFlight, meta: bytes) -> None:
        """In the saves' thread: DCP writes the files, then what a synchronous save does after its writes, each step
        agreed by every rank."""
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # (a new thread's is device 0)
            writer = StagedWriter(files.partial_path(inflight.path), self.stager.landed)
            _agree_on(lambda: dcp.save(staged, storage_writer=writer, process_group=self.group), self.group)
            partial = files.partial_path(inflight.path)
            commit_sharded(inflight.path, lambda: _write_bytes(partial / files.META, meta), self.group)
            with inflight.lock:
                inflight.committed = True
            for remove in inflight.removals:
                _remove_quietly(remove)
        except BaseException as err:  # noqa: BLE001 - raised on the training thread
            inflight.done.set_exception(err)
            return
        inflight.seconds = time.perf_counter() - inflight.started
        inflight.done.set_result(None)

    def failed(self) -> bool:
        """This rank's save in flight has failed (no wait, no collective)."""
        inflight = self._inflight
        return inflight is not None and inflight.done.done() and inflight.done.exception() is not None

    def raise_failure(self) -> None:
        """The ranks agreed that a save failed somewhere: wait for this rank's to end and raise, naming it."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        raise _failure(inflight.path, [inflight.error() or f"rank {dist.get_rank()}: another rank's write failed"])

    def complete(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Wait for the save in flight (every rank); raise on every rank if it failed on any, naming it."""
        inflight = self._inflight
        if inflight is None:  # (the same on every rank: saves start together)
            return
        # interrupted here (a peer died, a KeyboardInterrupt), it stays in flight: the strategy's on_exception waits
        # for it on this rank and names it
        error = inflight.error()
        failures = sorted({e for e in from_every_rank(error, group) if e})  # (one failure, seen by every rank)
        self._inflight = None
        if failures:
            raise _failure(inflight.path, failures)
        self.last_seconds = inflight.seconds

    def wait_here(self, timeout: Optional[float] = None) -> Optional[str]:
        """After a failure elsewhere (no collective): wait up to ``timeout`` seconds for the save in flight to end on
        this rank; a sentence naming it if it did not commit, else None."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        error = inflight.error(timeout)
        if error is None and inflight.done.done():
            return None
        state = error if error is not None else f"still being written after {timeout:.0f} s"
        return (f"lightning_shard: the checkpoint {str(inflight.path)!r}, written in the background, did not complete"
                f" ({state}); any previous checkpoint at that path is intact.")

    def remove_after(self, remove: Callable[[], None]) -> None:
        """Remove a checkpoint once the save in flight has committed (at once if none is; never if it fails): a
        checkpoint rotated away must not go before the one replacing it is complete. Also any other change that
        must wait for that (``last`` linked to the checkpoint in flight)."""
        inflight = self._inflight
        if inflight is not None:
            with inflight.lock:
                if not inflight.committed:
                    inflight.removals.append(remove)
                    return
        _remove_quietly(remove)

    def close(self) -> None:
        """Free the staging memory and the thread (after :meth:`complete`)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self.stager.close()


def _agree_on(write: Callable[[], Any], group: Optional[dist.ProcessGroup]) -> None:
    """``write`` (DCP's save) on every rank, its outcome agreed: raise, naming each failure once, if it failed
    anywhere (DCP shares a failed write with every rank, each naming every rank's failure: as one)."""
    try:
        write()
        outcome = None
    except CheckpointException as err:
        outcome = "; ".join(f"rank {r}: {_described(e)}" for r, e in sorted(err.failures.items()))
    except Exception as err:  # noqa: BLE001 - shared below
        outcome = f"rank {dist.get_rank(group)}: {type(err).__name__}: {err}"
    failures = sorted({f for f in from_every_rank(outcome, group) if f})
    if failures:
        raise RankFailures("; ".join(failures))


def _described(failure: Any) -> str:
    """One rank's failure as DCP carries it (the exception, or the exception and its traceback)."""
    err = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(err).__name__}: {err}"


def _failure(path: Path, failures: list[str]) -> OSError:
    return OSError(f"lightning_shard: the checkpoint {str(path)!r}, written in the background, failed"
                   f" ({'; '.join(failures)}); any previous checkpoint at that path is intact.")


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _remove_quietly(remove: Callable[[], None]) -> None:
    """A rotated checkpoint that cannot be removed (or ``last`` not relinked) is left, said once: the save that
    replaced it is complete."""
    try:
        remove()
    except Exception as err:  # noqa: BLE001 - a leftover, not a failed save
        warnings.warn(f"lightning_shard: a checkpoint written in the background is complete, but removing or linking"
                      f" an older one after it failed ({err}); that one is left as it was.", stacklevel=2)
