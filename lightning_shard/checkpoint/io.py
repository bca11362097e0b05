"""Saving and opening Lightning checkpoints of a sharded model, in either format.

* **sharded** (a directory): every rank writes the shards it owns with ``torch.distributed.checkpoint``;
  rank 0 adds ``meta.pt`` (loops, schedulers, callbacks, optimizer groups) and the manifest.
* **full** (one file): rank 0 writes an ordinary Lightning checkpoint, gathered one unit at a time.

Both are written beside the target and moved into place only when complete, and both are checked before
anything is loaded from them. Opening reads only what each rank owns: a sharded checkpoint by DCP's
slicing, a full file through a memory map.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_shard.checkpoint import files, sharded
from lightning_shard.checkpoint.sharded_source import ShardedSource
from lightning_shard.engine.comm.collectives import from_every_rank

STATE_DICT_TYPES = ("sharded", "full")
CURRENT = "current_model_state"  # Lightning's WeightAveraging key: the weights trained, where state_dict is their average


def validate_state_dict_type(value: object) -> str:
    if value not in STATE_DICT_TYPES:
        raise ValueError(f"`state_dict_type` must be one of {', '.join(map(repr, STATE_DICT_TYPES))}; got {value!r}.")
    return value  # type: ignore[return-value]


def validate_async_save(value: object, state_dict_type: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`async_save` must be True or False, got {value!r}.")
    if value and state_dict_type != "sharded":
        raise ValueError("`async_save=True` writes sharded checkpoints in the background: it needs"
                         f" state_dict_type='sharded', got {state_dict_type!r} (a full checkpoint is gathered into rank"
                         " 0's memory and written by it alone).")
    return value


def save_sharded(checkpoint: dict[str, Any], path: Path, group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank calls this with its own ``checkpoint`` (as built by ``lightning_module_state_dict`` and
    ``optimizer_state`` in sharded mode). A failure anywhere, a dead rank included, raises on every rank
    that is still alive, within the process group timeout."""
    try:
        _save_sharded(checkpoint, path, group)
    except Exception as err:
        raise OSError(f"lightning_shard: saving the checkpoint {str(path)!r} failed ({err}); any previous"
                      " checkpoint at that path is intact.") from err


def _save_sharded(checkpoint: dict[str, Any], path: Path, group: Optional[dist.ProcessGroup]) -> None:
    rank = dist.get_rank(group)
    partial = files.partial_path(path)
    all_succeed(lambda: files.begin(path) if rank == 0 else None, group)
    items = split_checkpoint(checkpoint)
    sharded.save(items, partial)  # collective: a failure on any rank raises on every rank
    commit_sharded(path, lambda: torch.save(checkpoint, partial / files.META), group)


def split_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Take the tensors DCP writes out of ``checkpoint`` (what is left goes to ``meta.pt``), keyed as DCP saves them."""
    items = {sharded.MODEL_PREFIX + k: v for k, v in checkpoint.pop("state_dict").items()}
    # a weight-averaging callback's layout: the average in state_dict, the weights trained in current_model_state
    items.update({sharded.CURRENT_PREFIX + k: v for k, v in checkpoint.pop(CURRENT, {}).items()})
    if "optimizer_states" in checkpoint:  # (absent from a weights-only checkpoint, as Lightning leaves it)
        optimizer_meta = []
        for i, state in enumerate(checkpoint.pop("optimizer_states")):
            items.update({sharded.optimizer_prefix(i) + k: v for k, v in state["tensors"].items()})
            optimizer_meta.append({k: v for k, v in state.items() if k != "tensors"})
        checkpoint["optimizer_states"] = optimizer_meta
    return items


def commit_sharded(path: Path, write_meta: Callable[[], None], group: Optional[dist.ProcessGroup]) -> None:
    """Once every rank's DCP files are in ``PATH.partial``: their checksums, then rank 0 writes ``meta.pt`` (by
    ``write_meta``) and the manifest and moves the directory into place. A failure anywhere raises on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    partial = files.partial_path(path)
    everyone = all_succeed(lambda: files.checksums(partial, sharded.rank_files(partial, rank)), group)

    def write_meta_and_commit() -> None:
        if rank == 0:
            write_meta()
            files.finish(path, {k: v for theirs in everyone for k, v in theirs.items()}, world)

    all_succeed(write_meta_and_commit, group)


def all_succeed(step: Callable[[], Any], group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Run ``step`` on every rank and return every rank's result; if it failed anywhere, raise on every
    rank, naming each failure."""
    try:
        outcome = (step(), None)
    except Exception as err:  # noqa: BLE001 - shared below, then raised
        outcome = (None, f"rank {dist.get_rank(group)}: {err!r}")
    everyone = from_every_rank(outcome, group)
    failures = [error for _, error in everyone if error]
    if failures:
        raise RankFailures("; ".join(failures))
    return [result for result, _ in everyone]


class RankFailures(OSError):
    """A step of a save that failed on some ranks; its message names each rank's failure."""


def save_full(checkpoint: dict[str, Any], path: Path, io: Any, storage_options: Optional[Any] = None) -> None:
    """Rank 0 only: write beside the target, then move into place. ``io`` is a Lightning ``CheckpointIO``."""
    if "://" in str(path):  # remote storage: no rename; rely on the CheckpointIO
        return io.save_checkpoint(checkpoint, str(path), storage_options=storage_options)
    partial = files.partial_path(path)
    try:
        io.save_checkpoint(checkpoint, str(partial), storage_options=storage_options)
        files.commit(partial, path)
    except BaseException as err:
        if partial.is_file():
            os.remove(partial)
        raise OSError(f"lightning_shard: saving the checkpoint {str(path)!r} failed ({err}); any previous"
                      " checkpoint at that path is intact.") from err


def open_checkpoint(path: Path, group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
    """Check a checkpoint (every rank must call) and return its contents for Lightning to restore from.

    A full file is memory-mapped: ranks copy out only their slices. A directory yields its ``meta.pt``
    with a ``ShardedSource`` as ``state_dict``; model and optimizer shards are read when restored.
    """
    resolved = files.resolve(path)
    if resolved.is_file():
        files.verify_full_file(resolved, group)
        return files.load_weights(resolved, "checkpoint", mmap=True)
    files.verify_directory(resolved, group)
    checkpoint = files.load_weights(resolved / files.META, "checkpoint metadata")
    metadata = sharded.read_metadata(resolved)
    checkpoint["state_dict"] = ShardedSource(resolved, metadata)
    if any(key.startswith(sharded.CURRENT_PREFIX) for key in metadata.state_dict_metadata):
        checkpoint[CURRENT] = ShardedSource(resolved, metadata, sharded.CURRENT_PREFIX)
    return checkpoint
