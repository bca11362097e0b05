"""The overlapped host step's worker (host_step.py): one host thread running what it is given in order, with its
errors raised on the caller's thread. A gradient whose copy to the host has arrived is taken before any step (the end
of backward waits for those); one still on its way only when there is no step to do meanwhile (waiting for it first
would hold every step back until the whole backward had landed). The steps not started may be put in another order
(:meth:`HostWorker.reorder`: the one the next forward needs them in).

An error drops what was queued, and is raised on the host's thread where a rank's code reaches the same point on
every rank whenever the worker failed: a step's error where that unit's step is waited for (:meth:`wait_for`), or at
the end of the step (:meth:`wait`), not at the end of backward's wait for the landings, which may come before or after
the step failed. (Ranks raising at different points would meet each other's collectives: a hang.)

One thread: torch's CPU kernels (the fused AdamW) spread each tensor over the host's cores themselves; a second thread
would only contend for the same memory bandwidth, which is what bounds the step. On a GPU machine it spreads them over
all the host's cores but two (:func:`host_step_threads`), left to the threads that launch the device's work (the
training loop's, autograd's): torch's pool on every core, spinning between kernels, would delay the backward it
overlaps. An elementwise step's numbers do not depend on its threads.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Callable, Optional

import torch


class HostWorker:
    """One host thread running the callables it is given in order, gradients landing before steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cond = threading.Condition()
        self._lands: deque[tuple[Callable[[], None], Callable[[], bool]]] = deque()  # (work, whether it can run now)
        self._steps: deque[tuple[int, Callable[[], None]]] = deque()  # (the unit it steps, work)
        self._busy = False
        self._landing = False  # what it is busy with is a landing
        self._paused = False
        self._error: Optional[BaseException] = None
        self._error_landing = False  # the error came from a landing (else a step)
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()  # the thread chose its CPU threads (torch's count is per thread once set)

    def submit(self, work: Callable[[], None], ready: Optional[Callable[[], bool]] = None, key: int = -1) -> None:
        """A step (of unit ``key``), or (``ready`` given: whether its gradient has arrived) a landing."""
        with self._cond:
            if self._thread is None:
                threads = torch.get_num_threads()
                self._thread = threading.Thread(target=self._run, name="lightning_shard host step", daemon=True)
                self._thread.start()
                self._started.wait()
                torch.set_num_threads(threads)  # (this thread's, and the default of threads started later, as before)
            if ready is None:
                self._steps.append((key, work))
            else:
                self._lands.append((work, ready))
            self._cond.notify_all()

    def _next(self) -> tuple[Callable[[], None], bool]:
        """(Under the lock, something to do: it, and whether it is a landing.) Landings arrive in order: the first one
        tells."""
        steps = self._steps and not self._paused
        if self._lands and (not steps or _arrived(self._lands[0][1])):
            return self._lands.popleft()[0], True
        return self._steps.popleft()[1], False

    def _run(self) -> None:
        try:
            if self.device.type == "cuda" and self.device.index is not None:
                torch.cuda.set_device(self.device)  # per thread: the rank's device, not device 0
            threads = host_step_threads() if self.device.type == "cuda" else None
            if threads:
                torch.set_num_threads(threads)
        except BaseException as err:  # noqa: BLE001 - re-raised on the host's thread (nothing runs after it)
            self._error = err
        finally:
            self._started.set()
        while True:
            with self._cond:
                while not (self._lands or (self._steps and not self._paused)):
                    self._cond.wait()
                work, landing = self._next()
                self._busy, self._landing = True, landing
            try:
                if self._error is None:  # after an error, what was queued is dropped (raised at the next wait)
                    with torch.no_grad():
                        work()
            except BaseException as err:  # noqa: BLE001 - re-raised on the host's thread
                with self._cond:
                    self._error, self._error_landing = err, landing
                    self._lands.clear()
                    self._steps.clear()
            finally:
                with self._cond:
                    self._busy = self._landing = False
                    self._cond.notify_all()

    def wait(self, lands_only: bool = False) -> None:
        """Until every landing (and, unless ``lands_only``, every step) given so far has run; raises the worker's
        error here, on the caller's thread. (``lands_only`` does not wait for a step running now: it waited for every
        step queued, one after the other, where each landing queues its unit's step.)"""
        with self._cond:
            while self._lands or self._landing or (not lands_only and (self._busy or (self._steps and not self._paused))):
                self._cond.wait()
            if lands_only and not self._error_landing:
                return  # (a step's error: raised where that step is waited for)
        self.raise_error()

    def wait_for(self, done: Callable[[], bool]) -> None:
        """Until ``done()`` (asked under :attr:`lock`, which the work marks what it did under), or until nothing is
        left to run, or the worker failed before it was done: its error raised here."""
        with self._cond:
            while not done() and self._error is None and (self._busy or self._lands or (self._steps and not self._paused)):
                self._cond.wait()
            if done():
                return
        self.raise_error()

    @property
    def lock(self) -> threading.Condition:
        return self._cond

    def on_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def reorder(self, rank: Callable[[int], int]) -> None:
        """The steps not started, in the order of ``rank(key)`` (stable)."""
        with self._cond:
            self._steps = deque(sorted(self._steps, key=lambda step: rank(step[0])))

    def pause(self) -> list[Callable[[], None]]:
        """Stop taking steps; once the one running (if any) is done, return those not started (taken off). An error
        of the worker's is left for the next :meth:`wait` or :meth:`raise_error` (after the caller's undo)."""
        with self._cond:
            self._paused = True
            while self._busy or self._lands:
                self._cond.wait()
            left, self._steps = [work for _, work in self._steps], deque()
        return left

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error


def host_step_threads() -> Optional[int]:
    """The worker's CPU threads on a GPU machine: the host's cores but two (at least one); the environment variable
    ``LIGHTNING_SHARD_HOST_STEP_THREADS`` sets another count (0: torch's own, every core)."""
    chosen = os.environ.get("LIGHTNING_SHARD_HOST_STEP_THREADS")
    if chosen is not None:
        if not chosen.isdigit():
            raise ValueError(f"LIGHTNING_SHARD_HOST_STEP_THREADS must be a whole number of threads (0: torch's own);"
                             f" got {chosen!r}.")
        return int(chosen) or None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 2)


def _arrived(ready: Callable[[], bool]) -> bool:
    """Whether a landing's copy has arrived; True where asking fails (a CUDA error): the landing runs, and its own wait
    for the copy raises the error where the worker catches it. Raised here, it ended the thread, and the host waited
    for it forever."""
    try:
        return ready()
    except Exception:  # noqa: BLE001 - raised again by the landing
        return True
