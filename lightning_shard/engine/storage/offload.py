"""CPU offload: a unit's training state in host memory, its optimizer stepped by the CPU.

``offload="optimizer"`` (ZeRO-Offload): the fp32 master shard, its gradient and so the optimizer's state live in
host memory (pinned on a GPU machine); the device keeps the shard in the compute dtype between steps, the
all-gather's input. ``offload="params"`` (FSDP2's ``CPUOffloadPolicy``) keeps nothing of the unit on the device
between steps: each all-gather copies the shard in, on the gather stream, ahead of use (the prefetch bound).

Per step: each unit's reduced gradient shard is copied to the host on the reduce stream as soon as its reduction
completes (overlapping the rest of backward). Overlapped (host_step.py, where armed): a host thread waits for each
unit's copy, steps that unit, makes its staging copy and queues its copy back to the device while backward goes on.
Serial (otherwise): the host waits for the copies once, at the end of backward, and the optimizer steps the host
shards; the next gathers make the staging copies and copy them back.

Note: the host-to-device copies read a pinned *staging* copy of the shard in the compute dtype (cast on the host:
half the bytes over PCIe under bf16), never the master shard itself: the optimizer writes the master while copies
may still be queued, whereas the staging copy is rewritten only after its last copy has landed. It is rewritten
from the master at the first gather of every step (whatever wrote the shards between steps: the optimizer, a load,
a callback's ``p.data.clamp_()``; unless ``restage_each_step`` is off, where the overlapped step made it and no hook
of the user's runs between steps), after every optimizer step (a second forward in the same step), whenever the
shard's version counter moved, and whenever a shard parameter's ``.data`` was touched. Not counted on: fused
optimizers and ``.data`` writes leave the counter alone.

On a CPU run the "device" is the host: the same code runs with plain host copies, which changes nothing for memory
but lets the host-step path be tested without a GPU.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn


OFFLOAD = (None, "optimizer", "params")


def validate_offload(value: object) -> Optional[str]:
    if value is False:
        return None
    if value not in OFFLOAD:
        raise ValueError(
            f"`offload` must be None (null in a Hydra config: everything on the device), 'optimizer' (master weights,"
            f" gradients and"
            f" optimizer state in host memory, stepped by the CPU) or 'params' (also no shard on the device"
            f" between steps); got {value!r}.")
    return value  # type: ignore[return-value]


class _Landed:
    """Whether copies issued on the device have landed: a CUDA event, or nothing to wait for on the host."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._event: Optional[torch.cuda.Event] = None

    def record(self) -> None:
        if self._cuda:
            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream: the one that issued the copies

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def arrived(self) -> bool:
        """Whether the copies have landed (without waiting)."""
        return self._event is None or self._event.query()

    def wait_on_device(self) -> None:
        """The current stream waits for the copies (the host does not)."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None


# what tells nothing of a parameter's values (nor changes them): answered at once, its unit's step still to come or not
# (a step's start reads every unit's requires_grad before the forward; the step changes none of these)
_METADATA = frozenset([*(getattr(Tensor, name).__get__ for name in (
    "requires_grad", "shape", "dtype", "device", "is_leaf", "ndim", "layout", "is_sparse", "is_cuda", "is_meta",
    "grad_fn", "itemsize", "nbytes")), Tensor.size, Tensor.dim, Tensor.numel, Tensor.nelement, Tensor.element_size,
    Tensor.is_floating_point, Tensor.is_complex])


def _after_the_step(cls: type, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
    """The shard parameters' ``__torch_function__`` while their unit's step is still to come: any use waits for it."""
    host = cls._host()
    if host is not None and host.await_step is not None and func not in _METADATA:
        host.settle()
    with torch._C.DisableTorchFunctionSubclass():  # (as nn.Parameter: plain tensors out)
        return func(*args, **(kwargs or {}))


class _HostShardParameter(nn.Parameter):
    """An offloaded unit's shard parameter (the master, between steps): ``.data``, read or set, makes the unit's
    copies for the device stale, as an in-place write's version bump does (a write through ``.data`` bumps none).
    The overlapped step reuses the copies it made (``restage_each_step`` off): a weight constraint written through
    ``.data`` in ``training_step``, before the forward, must reach that forward (WGAN's clipping). And while the unit's
    step is still to come (host_step.py's ``finish_in_forward``), any use of it (an op, ``.grad``, ``.data``) waits for
    it (:func:`_after_the_step`, its class's ``__torch_function__`` then; nn.Parameter's otherwise, which torch skips at
    no cost): a penalty over ``self.parameters()`` in ``training_step`` reads the stepped values. Not what tells nothing
    of its values (``_METADATA``: its shape, dtype, ``requires_grad``): a step's start reads those of every unit, and
    the forward would wait for the whole step there."""

    _host: Callable[[], Optional["HostMaster"]]

    @property  # type: ignore[override]
    def data(self) -> Tensor:
        self._copies_stale()
        return Tensor.data.__get__(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        self._copies_stale()
        Tensor.data.__set__(self, value)

    def _copies_stale(self) -> None:
        host = self._host()
        if host is not None:
            host.forget_staging()


class HostMaster:
    """Where an offloaded unit's shard lives: its master (and so the shard parameters, their gradients and the
    optimizer's state) in host memory, and the copies that move it: the staging copy in the gather dtype, the device's
    copy (``keep_on_device``: the compute-dtype shard stays on the device between steps), the gradient shards brought
    back. A part of the unit's storage (``FlatShard.host``, either layout), which hands itself to the calls that need
    its layout (the gather input it writes)."""

    def __init__(self, device: torch.device, keep_on_device: bool) -> None:
        self.device = device  # where the unit computes
        self.pinned = device.type == "cuda"  # page-locked host memory, where a GPU copies from and to it
        self.keep_on_device = keep_on_device
        # this part in a class attribute, one class per unit: an attribute of the tensor would be pickled with it
        self.parameter_class = type("HostShardParameter", (_HostShardParameter,), {"_host": weakref.ref(self)})
        self.master: Optional[Tensor] = None  # the master shard, in host memory (read it through settled_master)
        self._await_step: Optional[Callable[[], None]] = None
        self._sent: Optional[Tensor] = None  # what the gathered buffer was made of, while it is allocated (_device_copy)
        self._stale = True  # the shards were written since the staging copy was made (shards_changed)
        self._staged_version = -1  # the shard's version counter when the staging copy was made
        self.stagings = 0  # how many times the staging copy was made: what the device copy is of
        self._staging_read = _Landed(device)  # the last copy from the staging buffer to the device
        self._grads_landed = _Landed(device)
        self._on_device: Optional[Tensor] = None  # keep_on_device: the shard in the compute dtype
        self._on_device_of = -1  # the staging it copies
        self._uploaded = _Landed(device)  # its copy queued by the overlapped step, on another stream
        self.uploads = 0  # copies of the master to the device the overlapped step made (tests)
        self._staged_by_step = False  # the overlapped step staged the new values: the step's end changes nothing

    def new_master(self, numel: int, dtype: torch.dtype) -> Tensor:
        """The master shard, zeros in host memory (the storage fills it, then :meth:`bind` s this part to its layout)."""
        self.master = torch.zeros(numel, dtype=dtype, pin_memory=self.pinned)
        return self.master

    def bind(self, shard_numel: int, gather_dtype: torch.dtype, param_dtype: torch.dtype,
             master_dtype: torch.dtype) -> None:
        """The storage's layout, once it has one: the shard's elements (bytes, for a unit of several dtypes), the gathered
        buffer's dtype, the compute and master dtypes."""
        self.shard_numel, self.gather_dtype = shard_numel, gather_dtype
        self.param_dtype, self.master_dtype = param_dtype, master_dtype
        self._staging = torch.empty(shard_numel, dtype=gather_dtype, pin_memory=self.pinned)

    def settled_master(self) -> Tensor:
        """This rank's master shard, after the unit's step where that is still to come (``finish_in_forward``): what
        reads or writes it directly, not through the shard parameters (a weight average's update after each step, a
        load), sees the stepped values, and is not overwritten by the step after it."""
        self.settle()
        assert self.master is not None
        return self.master

    @property
    def await_step(self) -> Optional[Callable[[], None]]:
        """Waits for the unit's step, still to come after ``optimizer.step()`` returned (host_step.py), or None."""
        return self._await_step

    @await_step.setter
    def await_step(self, waiting: Optional[Callable[[], None]]) -> None:
        self._await_step = waiting
        # its shard parameters' guard only then: elsewhere a Python call per use (~1 us: 5 per parameter of a step)
        self.parameter_class.__torch_function__ = (classmethod(_after_the_step) if waiting is not None
                                                   else torch._C._disabled_torch_function_impl)

    # -- host to device -----------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for this unit's overlapped step where it is still to come (host_step.py's ``finish_in_forward``)."""
        waiting = self._await_step
        if waiting is not None:
            waiting()

    def stepped_late(self) -> None:
        """(The worker, under its lock.) Stepped and staged after the optimizer step's end: nothing waits, and no
        step's end is left to take the staging as its own."""
        self.await_step = None
        self._staged_by_step = False

    def shards_changed(self) -> None:
        """The storage's shards were written (an optimizer step, a load): its copies are stale."""
        self.settle()
        if self._staged_by_step:  # the optimizer step's end, after the overlapped step staged what it wrote
            self._staged_by_step = False
            return
        self._stale = True

    def forget_staging(self) -> None:
        """The shard was written again after :meth:`stage_after_step` (a speculative step undone), or may have been
        (a shard parameter's ``.data``)."""
        self.settle()
        self._staged_by_step = False
        self._stale = True

    def stage_after_step(self, storage: Any, copy_stream: Optional[torch.cuda.Stream]) -> None:
        """The overlapped step (host_step.py, its worker thread), right after stepping this shard, while the device
        computes. ``params``: the staging copy made from the new values (the gathers copy it in). ``optimizer``: the
        master shard itself copied to the device on ``copy_stream`` and cast there into the device's copy, with no
        staging cast on the host (half the host's memory traffic of a cast, and none of its cores); the next gather
        only waits for that copy. Safe without a staging copy: the next write to this master is this unit's next
        step, after its next gradient landed, which the device made after a gather that waited for this copy; a
        write from anywhere else (an undone step, a load, ``p.data`` between steps) makes the next gather copy it
        again after this copy, which it waits for first (:meth:`_device_copy`). ``storage``: the shard's, which writes
        the staging copy."""
        if not self.keep_on_device:
            self._stale = True
            self._staged(storage)
        else:
            if self._on_device is None:
                self._on_device = torch.empty(self.shard_numel, dtype=self.param_dtype, device=self.device)
            with torch.cuda.stream(copy_stream) if copy_stream is not None else nullcontext():
                if self.pinned and self.master_dtype != self.param_dtype:
                    master = torch.empty(self.shard_numel, dtype=self.master_dtype, device=self.device)
                    master.copy_(self.settled_master(), non_blocking=True)
                    self._on_device.copy_(master)  # the cast, on the device (round to nearest even, as the host's)
                else:
                    self._on_device.copy_(self.settled_master(), non_blocking=True)
                self._uploaded.record()
            self.uploads += 1
            self._stale, self._staged_version = False, self.settled_master()._version
            self._on_device_of = self.stagings  # (the staging copy itself is rewritten before it is read again)
        self._staged_by_step = True

    def _staged(self, storage: Any) -> Tensor:
        """The staging copy, rewritten first (by ``storage``, in its layout) if the shard may have changed since (its
        version counter moved, or :meth:`shards_changed`: fused optimizers and ``.data`` writes leave the counter
        alone)."""
        version = self.settled_master()._version  # (after this unit's step, where it is still to come)
        if self._stale or self._staged_version != version:
            self._staging_read.wait()  # never rewrite what a queued copy still reads
            storage.write_gather_input(self._staging)
            self._stale, self._staged_version = False, version
            self.stagings += 1
        return self._staging

    def _to_device(self, storage: Any, out: Tensor) -> Tensor:
        out.copy_(self._staged(storage), non_blocking=True)
        self._staging_read.record()
        return out

    def _device_copy(self, storage: Any) -> Tensor:
        """The compute-dtype shard on the device, in the current stream's order (the gather stream's); kept as what
        the gathered buffer was made of until the buffer is freed (:meth:`unwritten` compares them)."""
        if not self.keep_on_device:
            self._sent = self._to_device(storage, torch.empty(self.shard_numel, dtype=self.gather_dtype,
                                                              device=self.device))
            return self._sent
        staged = self._staged(storage)  # (after this unit's step, where it is still to come)
        self._uploaded.wait_on_device()  # a copy the overlapped step queued (on CUDA; else done already)
        if self._on_device is None:
            self._on_device = torch.empty(self.shard_numel, dtype=self.gather_dtype, device=self.device)
        if self._on_device_of != self.stagings:
            self._on_device.copy_(staged, non_blocking=True)
            self._staging_read.record()
            self._on_device_of = self.stagings
        self._sent = self._on_device
        return self._on_device

    def gather_input(self, storage: Any) -> Tensor:
        """This rank's contribution to the all-gather, on the device (``storage``: the shard's, which writes it)."""
        return self._device_copy(storage)

    def fill_gathered(self, storage: Any, buffer: Tensor) -> None:
        """One rank: the gathered buffer is the shard copied in."""
        buffer.copy_(self._device_copy(storage))

    def freed(self) -> None:
        """The gathered buffer was freed: nothing was sent into one."""
        self._sent = None

    def unwritten(self, local: Tensor) -> bool:
        """Whether this rank's part of the gathered buffer (``local``, on the device) is still what was copied in: no
        code wrote it, and nothing needs to come back to the host (one wait for the device per unit gathered where code
        may write it: an offloaded step waits for its host anyway)."""
        return self._sent is not None and torch.equal(local, self._sent)

    def written_back(self) -> None:
        """What code wrote into the gathered copy was kept in the master: the device's copies are made again."""
        self.forget_staging()
        self._sent = None  # (no longer what the master's copies will be: compared with the master from now on)

    # -- device to host -----------------------------------------------------------------------------
    def grad_to_host(self, reduced: Tensor) -> Tensor:
        """Start copying the reduced gradient shard to host memory (in the current stream's order, the reduce
        stream's): the returned buffer is read after :meth:`await_host_grads`."""
        host = torch.empty(reduced.numel(), dtype=reduced.dtype, pin_memory=self.pinned)
        host.copy_(reduced, non_blocking=True)
        self._grads_landed.record()
        return host

    def await_host_grads(self) -> None:
        self._grads_landed.wait()

    def grads_arrived(self) -> bool:
        """Whether the gradient's copy to the host has landed (:meth:`await_host_grads` would not wait)."""
        return self._grads_landed.arrived()
