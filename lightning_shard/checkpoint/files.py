"""Checkpoints on disk: atomic commits, integrity checks, and reading that never unpickles code.

A sharded checkpoint is a directory written under ``PATH.partial`` and renamed to ``PATH`` only once every
rank's files are complete; ``manifest.json`` (written last) lists each file with its size and CRC-32, so a
directory without it is an interrupted save, and a truncated, corrupted or missing file is named on load.
A full checkpoint is one torch zip file, whose per-record CRC-32 (which ``torch.load`` does not check) is
verified before loading.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import pickle
import shutil
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from lightning_shard.engine.comm.collectives import from_every_rank

MANIFEST = "manifest.json"
META = "meta.pt"
FORMAT = "lightning_shard.sharded.v1"
_DCP_METADATA = ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, damaged, or does not fit the model."""


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def previous_path(path: Path) -> Path:
    return path.with_name(path.name + ".previous")


# -- writing ----------------------------------------------------------------------------------------
def begin(path: Path) -> Path:
    """A fresh, empty ``PATH.partial`` directory (a leftover of an interrupted save is discarded)."""
    partial = partial_path(path)
    if partial.exists():
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
    partial.mkdir(parents=True)
    return partial


def checksums(directory: Path, names: Iterable[str]) -> dict[str, dict[str, int]]:
    return {name: {"bytes": (directory / name).stat().st_size, "crc32": _crc32(directory / name)} for name in names}


def finish(path: Path, files: dict[str, dict[str, int]], world_size: int) -> None:
    """Write the manifest (the mark of completeness), then move the directory into place (rank 0 only)."""
    partial = partial_path(path)
    files = {**files, **checksums(partial, [n for n in (_DCP_METADATA, META) if (partial / n).exists()])}
    manifest = {"format": FORMAT, "world_size": world_size, "files": dict(sorted(files.items()))}
    with open(partial / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    commit(partial, path)


def commit(source: Path, path: Path) -> None:
    """Put ``source`` at ``path``. An existing checkpoint is swapped with it in one step where the system can
    (Linux's ``renameat2`` with ``RENAME_EXCHANGE``: ``path`` is never missing, so Lightning's ``ckpt_path="last"``
    finds it whenever the run stops), then removed. Elsewhere it is first moved aside: a kill between the two
    renames leaves both complete copies, and ``resolve`` finds them for an explicit path."""
    if (path.exists() or path.is_symlink()) and _exchange(source, path):
        _remove(source)  # now the earlier checkpoint: a leftover of a kill here is discarded by the next save
    else:
        previous = previous_path(path)
        if path.exists() or path.is_symlink():
            _remove(previous)
            os.rename(path, previous)
        os.rename(source, path)
        _remove(previous)
    _fsync_dir(path.parent)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system or the file system cannot."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # unsupported here: rename instead
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # (Windows: no process-wide library to open)
        return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


# -- reading ----------------------------------------------------------------------------------------
def resolve(path: Path) -> Path:
    """The complete checkpoint to read for ``path``: itself, or, when a save was killed between its two
    renames, the complete copy it left beside it."""
    if (path / MANIFEST).is_file():
        return path
    if not path.exists():
        for candidate in (partial_path(path), previous_path(path)):
            if (candidate / MANIFEST).is_file():
                return candidate
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    if path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a complete lightning_shard checkpoint: it has no {MANIFEST}, so its save did not"
            " finish (or it was not written by lightning_shard). Load an earlier checkpoint."
        )
    return path  # a file: a full checkpoint


def verify_directory(directory: Path, group: Optional[dist.ProcessGroup] = None, alone: bool = False) -> dict[str, Any]:
    """Check every file listed in the manifest (ranks share the reading); raise on every rank if any is bad.
    ``alone``: this process reads every file itself and runs no collective, whatever process group exists (a
    consolidation on one rank of a running job)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT:
            raise ValueError(f"unknown format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"The manifest of checkpoint {str(directory)!r} is unreadable: {err}") from err
    rank, world = _rank_world(group, alone)
    problems = []
    for i, (name, expected) in enumerate(sorted(files.items())):
        if i % world == rank:
            problems += _check_file(directory / name, expected)
    _raise_if_any(problems, directory, group, alone)
    return manifest


def _check_file(path: Path, expected: dict[str, int]) -> list[str]:
    if not path.is_file():
        return [f"{path.name}: missing"]
    size = path.stat().st_size
    if size != expected["bytes"]:
        return [f"{path.name}: {size} bytes, expected {expected['bytes']} (truncated or overwritten)"]
    if _crc32(path) != expected["crc32"]:
        return [f"{path.name}: contents do not match the checksum written at save time (corrupted)"]
    return []


def verify_full_file(path: Path, group: Optional[dist.ProcessGroup] = None, alone: bool = False) -> None:
    """Check a torch zip checkpoint's records against their CRC-32 (ranks share the reading; ``alone``: as
    :func:`verify_directory`)."""
    rank, world = _rank_world(group, alone)
    problems = []
    try:
        with zipfile.ZipFile(path) as archive:
            for i, info in enumerate(archive.infolist()):
                if i % world != rank:
                    continue
                try:
                    with archive.open(info) as record:
                        while record.read(1 << 24):
                            pass
                except (zipfile.BadZipFile, OSError, EOFError) as err:
                    problems.append(f"record {info.filename}: {err}")
    except (zipfile.BadZipFile, OSError) as err:
        problems.append(f"not a readable torch checkpoint ({err}); truncated or corrupted?")
    _raise_if_any(problems, path, group, alone)


def _rank_world(group: Optional[dist.ProcessGroup], alone: bool) -> tuple[int, int]:
    if not alone and dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _raise_if_any(problems: list[str], where: Path, group: Optional[dist.ProcessGroup], alone: bool) -> None:
    everyone = [problems] if alone else from_every_rank(problems, group)
    problems = sorted({p for rank_problems in everyone for p in rank_problems})
    if problems:
        raise CheckpointError(f"Checkpoint {str(where)!r} is damaged: " + "; ".join(problems))


def load_weights(path: Path, what: str, mmap: bool = False) -> Any:
    """``torch.load`` with ``weights_only=True``; a refusal names the class it met."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"Refusing to unpickle {what} {str(path)!r}: it holds objects other than tensors and plain"
            f" containers, and checkpoints are read with weights_only=True. ({err})"
        ) from err
    except RuntimeError as err:
        raise CheckpointError(f"Cannot read {what} {str(path)!r}: {err}") from err


# -- DCP metadata without arbitrary unpickling ------------------------------------------------------
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata file read by an unpickler that only builds DCP's own records."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / _DCP_METADATA
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointError(f"Cannot read checkpoint metadata {str(path)!r}: {err}") from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{str(path)!r} does not hold checkpoint metadata.")
        storage_meta = getattr(metadata, "storage_meta", False)
        if storage_meta is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = storage_meta = StorageMeta()
        if storage_meta and hasattr(storage_meta, "load_id"):
            storage_meta.load_id = getattr(self, "load_id", None)
        return metadata
