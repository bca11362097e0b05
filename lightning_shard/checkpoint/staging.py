"""A checkpoint's tensors copied to host memory, so that training can go on changing them while the copy is written.

:class:`HostStager` does what a ``torch.distributed.checkpoint`` ``AsyncStager`` does before ``dcp.async_save``
writes in the background. It copies every tensor a rank saves (the views of its parameter shards, its optimizer states, the
buffers) into host buffers kept across saves, and gives DCP the same items over those copies: each ``ShardedTensor``
rebuilt over its copied blocks with the same global metadata, placed on the host (kept too, and reused while the
layout is the same: rebuilding costs the training thread more than the copy, for small tensors). Each copy has a
storage of its own: DCP clones, before writing it, a tensor that is a view into a larger storage (as a synchronous
save's shard views are, one at a time).

Why not DCP's own ``DefaultStager``: it copies whole storages (a unit's flat shard, padding and the frozen parameters a
``save_frozen=False`` checkpoint leaves out included) into storages it allocates afresh for each ``async_save`` that
creates it (and keeps, where one is kept across saves, by the storage copied from: a weak reference, lost with
every new view); here only the bytes written are copied, into memory allocated once (first touched at the first save,
then reused: no page faults, no allocator churn), whose size is known before the first save (the memory estimate's
``checkpoint_staging``).

The strategy reserves that memory at setup (:meth:`HostStager.reserve`), its pages touched by a background thread of
low priority: the first save's copy would otherwise fault in every page (2 s for 2.5 GB a rank on the project's CPU
machine, against 0.4 s for the same copy into touched memory). The copies are cut from it, each over a storage of its
own (``torch.frombuffer`` over a slice); a layout that does not fit (the estimate is the bound for the optimizers it
probed) gets its own allocations.

Device tensors are copied with ``non_blocking`` into memory pinned once (``cudaHostRegister`` over the reserve, or over
each buffer: the caching host allocator would round each up to a power of two), on the current stream: the next
step's kernels, queued after them, cannot change what is copied; the writer waits for the copies
(:meth:`HostStager.landed`) before it writes. Host tensors (offloaded shards and optimizer state) are copied on the
spot.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import mmap
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata


def _firsts(items: dict[str, Any]) -> dict[int, tuple[str, Any]]:
    """Each distinct value of ``items`` with its first key: a tied parameter is one item under each of its names."""
    firsts: dict[int, tuple[str, Any]] = {}
    for key, value in items.items():
        firsts.setdefault(id(value), (key, value))
    return firsts


def leaves(items: dict[str, Any]) -> Iterator[Tensor]:
    """The tensors a save copies from ``items`` (DCP items), in a fixed order: each ShardedTensor's local blocks, a
    value under several names (tied parameters) once."""
    for _, value in _firsts(items).values():
        if isinstance(value, ShardedTensor):
            yield from (shard.tensor for shard in value.local_shards())
        elif isinstance(value, Tensor):
            yield value


def staged_bytes(items: dict[str, Any]) -> int:
    """Host memory :meth:`HostStager.copy` keeps for ``items``."""
    return sum(t.numel() * t.element_size() for t in leaves(items))


_ALIGN = 64  # bytes between the copies cut from the reserve: any dtype's alignment


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _pin(pointer: int, nbytes: int) -> None:
    code = torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 1)  # cudaHostRegisterPortable: any device's context
    if int(code) != 0:
        raise RuntimeError(f"lightning_shard: pinning {nbytes} bytes of host memory for checkpoint staging failed"
                           f" (cudaHostRegister: {code}).")


class _Reserve:
    """Host memory set aside for the copies, touched (and pinned, for a device) by a thread of low priority, a chunk at
    a time: the first copy stops it where it is, and faults in the pages it did not reach itself."""

    CHUNK = 1 << 24  # bytes touched between two looks at the stop flag

    def __init__(self, nbytes: int, device: Optional[torch.device]) -> None:
        self.memory = mmap.mmap(-1, nbytes)
        self.nbytes = nbytes
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.pinned = False
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._touch, args=(device,), daemon=True,
                                        name="lightning_shard_checkpoint_reserve")
        self._thread.start()

    def _touch(self, device: Optional[torch.device]) -> None:
        try:
            try:  # (Linux: a thread's own priority; the training threads come first)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (AttributeError, OSError):
                pass
            for offset in range(0, self.nbytes, self.CHUNK):  # (one thread, no GIL held)
                if self._stop.is_set():
                    return
                ctypes.memset(self.address + offset, 0, min(self.CHUNK, self.nbytes - offset))
            if device is not None and device.type == "cuda" and not self._stop.is_set():
                torch.cuda.set_device(device)
                self.pin()
        except BaseException as err:  # noqa: BLE001 - the first copy allocates its own memory instead
            self.error = err

    def pin(self) -> None:
        if not self.pinned:
            _pin(self.address, self.nbytes)
            self.pinned = True

    def ready(self) -> bool:
        """Stop the touching thread where it is; whether the memory can be used."""
        self._stop.set()
        self._thread.join()
        return self.error is None

    def finish_touching(self) -> None:
        """Wait for the touching thread to touch (and pin) it all."""
        self._thread.join()

    def cut(self, layout: tuple[tuple[torch.Size, torch.dtype], ...]) -> Optional[list[Tensor]]:
        """One tensor per ``layout`` entry, each over a slice of the reserve (a storage of its own); None if it
        does not fit."""
        sizes = [shape.numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout]
        if sum(_aligned(n) for n in sizes) > self.nbytes:
            return None
        view, offset, tensors = memoryview(self.memory), 0, []
        for (shape, dtype), nbytes in zip(layout, sizes):
            if nbytes == 0:
                tensors.append(torch.empty(shape, dtype=dtype))
                continue
            tensors.append(torch.frombuffer(view[offset : offset + nbytes], dtype=torch.uint8).view(dtype).view(shape))
            offset += _aligned(nbytes)
        return tensors

    def release(self) -> None:
        self.ready()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False


class HostStager:
    """Stages one rank's checkpoint items into host memory it keeps for the next save (see the module note)."""

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []  # one per tensor saved, each its own storage
        self._layout: Optional[tuple[tuple[torch.Size, torch.dtype], ...]] = None
        self._registered: list[int] = []  # pointers pinned by cudaHostRegister
        self._pinned = False  # the buffers were made for device tensors
        self._copies: Optional[torch.cuda.Event] = None  # device copies in flight
        self._rebuilt_before: dict[str, tuple[Any, ShardedTensor]] = {}  # key -> (its layout, over the copies)
        self._reserve: Optional[_Reserve] = None

    @property
    def held_bytes(self) -> int:
        """Host memory kept between saves."""
        return self._reserve.nbytes if self._reserve is not None else self.copied_bytes

    @property
    def copied_bytes(self) -> int:
        """What a save copies (the last one's layout)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def reserve(self, nbytes: int, device: Optional[torch.device] = None) -> None:
        """Set ``nbytes`` of host memory aside for the copies now (the memory estimate's ``checkpoint_staging``, plus 1%
        and 1 MiB), touched, and pinned for ``device`` if it is a GPU, by a background thread (see the module note)."""
        if nbytes > 0 and self._reserve is None and not self._buffers:  # (1% more: alignment, scalar states)
            self._reserve = _Reserve(nbytes + nbytes // 100 + 2**20, device)

    def wait_reserved(self) -> None:
        """Wait until the reserve is touched (a benchmark's first save, as in a run whose setup was steps before)."""
        if self._reserve is not None:
            self._reserve.finish_touching()

    @torch.no_grad()
    def copy(self, items: dict[str, Any]) -> dict[str, Any]:
        """``items`` (DCP items) over copies in host memory; anything else in it deep-copied."""
        sources = list(leaves(items))
        on_device = any(t.device.type == "cuda" for t in sources)
        self._ensure_buffers(tuple((t.shape, t.dtype) for t in sources), pin=on_device)
        for target, source in zip(self._buffers, sources):
            target.copy_(source, non_blocking=source.device.type == "cuda")
        if on_device:
            self._copies = torch.cuda.Event()
            self._copies.record()  # on the current stream, which the copies were queued on
        copies = iter(self._buffers)
        made = {i: self._rebuilt(key, value, copies) for i, (key, value) in _firsts(items).items()}
        return {key: made[id(value)] for key, value in items.items()}  # (tied: one copy under each name)

    def landed(self) -> None:
        """Wait for the device copies of the last :meth:`copy` (the writer calls it before reading them)."""
        if self._copies is not None:
            self._copies.synchronize()
            self._copies = None

    def close(self) -> None:
        """Free the kept host memory."""
        self.landed()
        self._release()
        if self._reserve is not None:
            self._reserve.release()
            self._reserve = None

    def _rebuilt(self, key: str, value: Any, copies: Iterator[Tensor]) -> Any:
        if isinstance(value, ShardedTensor):
            metadata = value.metadata()
            local = [next(copies) for _ in value.local_shards()]
            layout = (tuple(metadata.size), metadata.tensor_properties.dtype,
                      tuple((tuple(md.shard_offsets), tuple(md.shard_sizes), md.placement.rank())
                            for md in metadata.shards_metadata),
                      tuple(t.data_ptr() for t in local))
            before = self._rebuilt_before.get(key)
            if before is not None and before[0] == layout:  # the same blocks, copied to the same place: as it was
                return before[1]
            shards = [Shard(t, _on_host(shard.metadata)) for t, shard in zip(local, value.local_shards())]
            pinned = bool(shards) and shards[0].tensor.is_pinned()
            on_host = ShardedTensorMetadata([_on_host(md) for md in metadata.shards_metadata], metadata.size,
                                            dataclasses.replace(metadata.tensor_properties, pin_memory=pinned))
            rebuilt = ShardedTensor._init_from_local_shards_and_global_metadata(shards, on_host)
            self._rebuilt_before[key] = (layout, rebuilt)
            return rebuilt
        if isinstance(value, Tensor):
            return next(copies)
        return copy.deepcopy(value)  # (what a module's get_extra_state gives: written later, as it is now)

    def _ensure_buffers(self, layout: tuple[tuple[torch.Size, torch.dtype], ...], pin: bool) -> None:
        if layout == self._layout and (self._pinned or not pin):
            return
        self.landed()
        self._release()
        self._layout, self._pinned = layout, pin
        if self._reserve is not None:
            cut = self._reserve.cut(layout) if self._reserve.ready() else None
            if cut is not None and pin and torch.cuda.is_available():
                try:
                    self._reserve.pin()  # (where the touching thread did not get that far)
                except RuntimeError:
                    cut = None
            if cut is not None:
                self._buffers = cut
                return
            self._reserve.release()  # (it does not fit: allocated here instead, and the reserve given back)
            self._reserve = None
        self._buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in layout]
        if pin and torch.cuda.is_available():
            try:
                for buffer in self._buffers:
                    nbytes = buffer.numel() * buffer.element_size()
                    if nbytes:
                        _pin(buffer.data_ptr(), nbytes)
                        self._registered.append(buffer.data_ptr())
            except RuntimeError as err:  # still right, slower: a copy into pageable memory waits for the device
                self._unpin()
                warnings.warn(f"{err} The copies go to pageable host memory: each save waits for them.", stacklevel=3)

    def _unpin(self) -> None:
        for pointer in self._registered:
            torch.cuda.cudart().cudaHostUnregister(pointer)
        self._registered = []

    def _release(self) -> None:
        self._unpin()
        self._buffers, self._layout, self._pinned = [], None, False
        self._rebuilt_before.clear()


def _on_host(md: ShardMetadata) -> ShardMetadata:
    """``md`` placed on its rank's host memory (the staged copy's device)."""
    return ShardMetadata(list(md.shard_offsets), list(md.shard_sizes), f"rank:{md.placement.rank()}/cpu")
