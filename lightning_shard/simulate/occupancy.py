"""How long a simulated collective holds what it was issued on, and on what.

On CUDA a collective is a spin kernel on the stream it was issued on (``torch.cuda._sleep``, its cycles calibrated
against the clock once per device), so the stream is busy for the modeled time, as it would be under NCCL, and
``work.wait()`` makes the current stream wait for it (NCCL's semantics). On the CPU it is a time the host waits in
``work.wait()`` (or at once, issued synchronously), counted from the issue.

Link sharing (``sharing``): ``"serial"`` (the default) runs the collectives of one link one at a time in issue order,
whatever stream issued them: a gather beside a reduce-scatter takes as long as both, which is what splitting the
link's bandwidth between them gives in total (the first to be issued finishes earlier than it would sharing, so this
is pessimistic for the second). ``"free"`` gives each collective the whole link (optimistic where two overlap).
Left out: the SMs a real NCCL kernel occupies (16 to 32 channels, one block each, of 132 on an H100), which slow the
compute that overlaps a collective; the spin kernel is one block.

The stand-in outputs written on the device (see standins.py) take time of their own; on CUDA it is taken off the
spin, at the device's copy rate measured with the calibration.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

SHARING = ("serial", "free")


class SimulatedWork(dist.Work):
    """A collective in flight: ``wait()`` returns when its modeled time has passed (host), or makes the current
    stream wait for its spin (CUDA)."""

    def __init__(self, result: list, end: Optional[float] = None, done: Optional[Any] = None) -> None:
        super().__init__()
        self._result, self._end, self._done = result, end, done

    def wait(self, timeout: Any = None) -> bool:
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        elif self._end is not None:
            left = self._end - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return True

    def is_completed(self) -> bool:
        if self._done is not None:
            return self._done.query()
        return self._end is None or time.perf_counter() >= self._end

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> list:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


class Spin:
    """A CUDA device's spin kernel, calibrated: ``torch.cuda._sleep`` cycles per second, and the device's copy rate."""

    def __init__(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda._sleep(1000)  # the kernel loaded before it is timed
            lo, hi = 2_000_000, 42_000_000
            self.cycles_per_second = (hi - lo) / (self._best(lambda: torch.cuda._sleep(hi))
                                                  - self._best(lambda: torch.cuda._sleep(lo)))
            src = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            self.copy_bytes_per_second = src.numel() / self._best(lambda: dst.copy_(src))

    @staticmethod
    def _best(work: Any, tries: int = 3) -> float:
        times = []
        for _ in range(tries):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        return min(times)

    def run(self, seconds: float) -> None:
        cycles = int(seconds * self.cycles_per_second)
        if cycles > 0:
            torch.cuda._sleep(cycles)


class Occupancy:
    """Every link's queue of collectives (see the module note) and every CUDA device's spin kernel."""

    def __init__(self, sharing: str = "serial") -> None:
        if sharing not in SHARING:
            raise ValueError(f"sharing must be one of {SHARING}, got {sharing!r}")
        self.sharing = sharing
        self._free_at: dict[str, float] = {}  # host: when each link is next free
        self._last: dict[str, Any] = {}  # CUDA: each link's last collective's end event
        self._spins: dict[int, Spin] = {}

    def spin(self, device: torch.device) -> Spin:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._spins:
            self._spins[index] = Spin(torch.device("cuda", index))
        return self._spins[index]

    def occupy(self, link: str, seconds: float, device: torch.device, written: int, result: list) -> SimulatedWork:
        """A collective on ``link`` for ``seconds``, issued now; ``written``: bytes its stand-in wrote on the device."""
        if device.type == "cuda":
            return self._on_stream(link, seconds, device, written, result)
        start = time.perf_counter()
        if self.sharing == "serial":
            start = max(start, self._free_at.get(link, 0.0))
            self._free_at[link] = start + seconds
        return SimulatedWork(result, end=start + seconds if seconds > 0 else None)

    def _on_stream(self, link: str, seconds: float, device: torch.device, written: int,
                   result: list) -> SimulatedWork:
        stream = torch.cuda.current_stream(device)
        queued = self.sharing == "serial" and seconds > 0  # (a free collective holds no link: nothing to order)
        if queued and link in self._last:
            stream.wait_event(self._last[link])
        if seconds > 0:
            spin = self.spin(device)
            with torch.cuda.stream(stream):
                spin.run(seconds - written / spin.copy_bytes_per_second)
        done = torch.cuda.Event()
        done.record(stream)
        if queued:
            self._last[link] = done
        return SimulatedWork(result, done=done)
