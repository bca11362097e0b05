"""Where the engine's device work runs, and the hand-overs between streams.

Three streams: **compute** (the caller's current stream: forward, backward, the optimizer), **gather**
(the copy-in/cast of a unit's shard and its all-gather) and **reduce** (flattening, casting and dividing a
unit's gradients, and their reduce-scatter). Every hand-over of a buffer from one stream to another is an
event recorded on the producer and waited by the consumer (:meth:`Streams.handover`); a collective's output
belongs to the stream that waited for it, as under NCCL, whose ``work.wait()`` makes the *current* stream
wait. Note: no ``record_stream``: a buffer is allocated and freed on the stream whose order governs its
reuse (gathered buffers on compute, the reduction's temporaries on reduce), and it is freed only after
every other stream that touched it has been waited for, so memory stays deterministic.

Two implementations of one interface:

* :class:`CudaStreams`: high-priority CUDA side streams and events; it also times how long the compute
  stream waited for each hand-over (the communication that was *exposed*), read once per step.
* :class:`HostStreams` (CPU): work runs in host order, hand-overs are free. With ``check=True`` it models
  the three streams with vector clocks and raises :class:`StreamRace` at any access to a buffer that is not
  ordered after the last conflicting access on another stream: the race a GPU would have, found on a CPU.
  The engine annotates its accesses (``reads``/``writes``) for it; they cost nothing unchecked.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Hashable, Iterator, Optional

import torch

STREAMS = ("compute", "gather", "reduce")


class StreamRace(AssertionError):
    """An access to a buffer that a GPU could run before, or during, another stream's access to it."""


class Streams:
    """The interface (and the host's behaviour): the hand-overs are no-ops when work runs in host order."""

    def on(self, stream: str) -> Any:
        """Make ``stream`` (``"gather"`` or ``"reduce"``) the current one for the work issued inside."""
        return nullcontext()

    def handover(self, producer: str, consumer: str) -> None:
        """``consumer`` waits for everything issued on ``producer`` so far."""

    def reads(self, *buffers: Hashable) -> None:
        """The current stream reads ``buffers`` (an annotation for the checker)."""

    def writes(self, *buffers: Hashable) -> None:
        """The current stream writes (or allocates, or frees) ``buffers`` (an annotation for the checker)."""

    def close_step(self) -> Optional[list]:
        """End of a step: what :meth:`exposed_seconds` needs to measure it, or None if host time measures it."""
        return None

    def exposed_seconds(self, closed: list) -> float:
        return 0.0


class HostStreams(Streams):
    """CPU: one host thread runs everything in order (gloo's async work is waited by the host)."""

    def __init__(self, check: bool = False) -> None:
        if check:  # the checking methods replace the no-ops on this instance only
            self._clock = {s: dict.fromkeys(STREAMS, 0) for s in STREAMS}  # what each stream has waited for
            self._current = ["compute"]
            self._last_write: dict[Hashable, tuple[str, int]] = {}
            self._reads: dict[Hashable, dict[str, int]] = {}
            self.on, self.handover = self._checked_on, self._checked_handover  # type: ignore[method-assign]
            self.reads, self.writes = self._checked_reads, self._checked_writes  # type: ignore[method-assign]

    @contextmanager
    def _checked_on(self, stream: str) -> Iterator[None]:
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def _checked_handover(self, producer: str, consumer: str) -> None:
        seen, waited = self._clock[producer], self._clock[consumer]
        for stream in STREAMS:
            waited[stream] = max(waited[stream], seen[stream])

    def _tick(self) -> tuple[str, int]:
        stream = self._current[-1]
        self._clock[stream][stream] += 1
        return stream, self._clock[stream][stream]

    def _ordered_after(self, stream: str, access: tuple[str, int]) -> bool:
        return access[0] == stream or self._clock[stream][access[0]] >= access[1]

    def _checked_reads(self, *buffers: Hashable) -> None:
        stream, tick = self._tick()
        for buffer in buffers:
            write = self._last_write.get(buffer)
            if write is not None and not self._ordered_after(stream, write):
                raise StreamRace(f"{buffer!r} is read on the {stream} stream without waiting for its write on the"
                                 f" {write[0]} stream")
            self._reads.setdefault(buffer, {})[stream] = tick

    def _checked_writes(self, *buffers: Hashable) -> None:
        stream, tick = self._tick()
        for buffer in buffers:
            earlier = [self._last_write.get(buffer)] + list(self._reads.get(buffer, {}).items())
            for access in filter(None, earlier):
                if not self._ordered_after(stream, access):
                    raise StreamRace(f"{buffer!r} is written on the {stream} stream without waiting for its last"
                                     f" access on the {access[0]} stream")
            self._last_write[buffer] = (stream, tick)
            self._reads[buffer] = {}


class CudaStreams(Streams):
    """Dedicated high-priority gather and reduce streams on ``device``, events for every hand-over.

    Note: each hand-over re-records one event per (producer, consumer) pair: a wait enqueued on a stream waits for
    the event's record at that moment, so later records leave it as it was. Only the pairs timing the compute
    stream's waits are new per hand-over, kept until the step's figure is read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = {name: torch.cuda.Stream(device, priority=-1) for name in ("gather", "reduce")}
        self._compute: list[torch.cuda.Stream] = []  # the caller's stream, saved while a side stream is current
        self._events = {(p, c): torch.cuda.Event() for p in STREAMS for c in STREAMS if p != c}
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._folded_seconds = 0.0  # stalls already measured, of a long loop with no step closed (evaluation)

    def _stream(self, name: str) -> torch.cuda.Stream:
        if name == "compute":
            return self._compute[-1] if self._compute else torch.cuda.current_stream(self.device)
        return self._side[name]

    def on(self, stream: str) -> "_OnSideStream":
        return _OnSideStream(self, self._side[stream])

    def handover(self, producer: str, consumer: str) -> None:
        event = self._events[producer, consumer]
        event.record(self._stream(producer))
        waiting = self._stream(consumer)
        if consumer != "compute":
            waiting.wait_event(event)
            return
        # the time the compute stream stands still here is communication that was not hidden
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(waiting)
        waiting.wait_event(event)
        after.record(waiting)
        self._stalls.append((before, after))
        if len(self._stalls) > 1024:  # bounded: fold the pairs that have run into a number
            ran = [pair for pair in self._stalls if pair[1].query()]
            self._folded_seconds += _seconds(ran)
            self._stalls = [pair for pair in self._stalls if pair not in ran]

    def close_step(self) -> Optional[list]:
        closed, self._stalls = [self._folded_seconds, *self._stalls], []
        self._folded_seconds = 0.0
        return closed

    def exposed_seconds(self, closed: list) -> float:
        """Blocks until the step's last hand-over has run: call it only when the figure is read."""
        folded, *pairs = closed
        return folded + _seconds(pairs)


class _OnSideStream:
    """``with streams.on(name):`` a side stream current for the work issued inside, what was current restored after.
    A plain object, not ``torch.cuda.stream()`` under ``@contextmanager``: it runs twice per unit per step.

    Note: ``torch.cuda.set_stream`` also makes the stream's device the current one: where another device was current
    (the engine used alone, its device not set as current), both that device and the stream are restored."""

    __slots__ = ("streams", "side", "previous", "current")

    def __init__(self, streams: CudaStreams, side: torch.cuda.Stream) -> None:
        self.streams, self.side = streams, side

    def __enter__(self) -> None:
        streams = self.streams
        self.previous = torch.cuda.current_stream(streams.device)  # this device's (another side stream, nested)
        self.current = torch.cuda.current_stream()  # the current device's
        streams._compute.append(streams._stream("compute"))
        try:
            torch.cuda.set_stream(self.side)
        except BaseException:
            streams._compute.pop()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            torch.cuda.set_stream(self.previous)
            if self.current.device_index != self.previous.device_index:
                torch.cuda.set_stream(self.current)
        finally:
            self.streams._compute.pop()


def _seconds(pairs: list) -> float:
    total = 0.0
    for before, after in pairs:
        after.synchronize()
        total += before.elapsed_time(after) / 1000
    return total


def streams_for(device: torch.device, check: bool = False) -> Streams:
    if device.type == "cuda":
        return CudaStreams(device)
    return HostStreams(check=check)
