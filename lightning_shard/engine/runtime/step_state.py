"""One step's state, in one place: where the step is (a :class:`Phase`), how deep the scopes open in it nest, and
what it keeps for later. Every change is one of :class:`StepState`'s transitions, each checked against the phases it
may start from; the runtime's parts read the state and call the transitions, nothing assigns it.

The phases a step goes through (``depth`` counts the scopes open: the root's ``*_step`` or forward, nested calls)::

    IDLE ──start_step──> FORWARD ──close (output needs no backward)──> IDLE
                            └─────close (output needs a backward)───> AWAITING_BACKWARD
    AWAITING_BACKWARD ──start_step──> FORWARD_AGAIN ──close──> AWAITING_BACKWARD      model(a) + model(b)
    IDLE ──a unit's forward with grad outside any scope──> AWAITING_BACKWARD          model(block(x))
    IDLE, AWAITING_BACKWARD, FORWARD, FORWARD_AGAIN ──begin_backward──> BACKWARD
    BACKWARD ──end_backward──> FORWARD (a scope still open: a manual backward inside a step), else IDLE
    IDLE, AWAITING_BACKWARD ──hold──> HELD, HELD_AWAITING ──release──> IDLE, AWAITING_BACKWARD      keep_gathered()
    HELD, HELD_AWAITING ──begin_backward──> HELD_BACKWARD ──end_backward──> HELD      (an earlier graph's backward)

Note: a backward's end forgets what awaited it (its graph was the one awaited), so BACKWARD needs no "awaiting"
twin; keep_gathered() keeps it, for after the hold.

Beside the phase: ``joined_by_all`` (the step now running is run by every rank of a shard group: it may agree at its
end), ``graph_kept`` (a ``create_graph=True`` backward ran: its graph may read the gathered buffers again, so none is
freed until an optimizer step) and ``steps_done`` (optimizer steps). The hooks read ``held``, ``backward_running``
and ``depth`` on every unit's call: plain attributes, set with the phase, as cheap as the flags they replace.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    """Where a step is; each member also says whether a forward's output awaits its backward, whether a backward is
    running (autograd's final callback is queued) and whether every unit is held gathered (keep_gathered())."""

    IDLE = ("idle", False, False, False)
    FORWARD = ("forward", False, False, False)  # a step's scope is open
    AWAITING_BACKWARD = ("awaiting backward", True, False, False)  # no scope open; a forward's output awaits
    FORWARD_AGAIN = ("forward again", True, False, False)  # a scope open while an earlier forward's output awaits
    BACKWARD = ("backward", False, True, False)
    HELD = ("held", False, False, True)
    HELD_AWAITING = ("held, awaiting backward", True, False, True)
    HELD_BACKWARD = ("held, in backward", False, True, True)

    def __init__(self, label: str, awaits_backward: bool, backward_running: bool, held: bool) -> None:
        self.label = label
        self.awaits_backward = awaits_backward
        self.backward_running = backward_running
        self.held = held


IDLE, FORWARD, AWAITING, AGAIN = Phase.IDLE, Phase.FORWARD, Phase.AWAITING_BACKWARD, Phase.FORWARD_AGAIN
BACKWARD, HELD, HELD_AWAITING, HELD_BACKWARD = Phase.BACKWARD, Phase.HELD, Phase.HELD_AWAITING, Phase.HELD_BACKWARD

# per transition: the phases it may start from, and the phase each leads to (with no scope open, with one open)
_START_STEP = {IDLE: FORWARD, AWAITING: AGAIN}
_AWAIT = {IDLE: AWAITING, AWAITING: AWAITING}
_BEGIN_BACKWARD = {IDLE: BACKWARD, AWAITING: BACKWARD, FORWARD: BACKWARD, AGAIN: BACKWARD, HELD: HELD_BACKWARD,
                   HELD_AWAITING: HELD_BACKWARD}
_END_BACKWARD = {BACKWARD: (IDLE, FORWARD), HELD_BACKWARD: (HELD, HELD)}
_HOLD = {IDLE: HELD, AWAITING: HELD_AWAITING}
_RELEASE = {HELD: (IDLE, FORWARD), HELD_AWAITING: (AWAITING, AGAIN), HELD_BACKWARD: (BACKWARD, BACKWARD)}
_CLOSE_LAST = {FORWARD: IDLE, AGAIN: AWAITING}  # the outermost scope closes (others keep their phase)
_NESTS = frozenset((FORWARD, AGAIN, BACKWARD, HELD, HELD_AWAITING, HELD_BACKWARD))  # a scope opens inside


class StepStateError(RuntimeError):
    """A transition from a phase it may not start from: a defect of the engine, never of the user's code."""


class StepState:
    __slots__ = ("phase", "depth", "held", "backward_running", "joined_by_all", "graph_kept", "steps_done")

    def __init__(self) -> None:
        self.phase = IDLE
        self.depth = 0  # scopes open (the root's *_step or forward; calls entering below the root)
        self.held = self.backward_running = False  # the phase's, for the hooks
        self.joined_by_all = False
        self.graph_kept = False
        self.steps_done = 0

    def __repr__(self) -> str:
        return f"StepState({self.phase.label}, depth={self.depth}, graph_kept={self.graph_kept})"

    @property
    def awaits_backward(self) -> bool:
        """A forward's output awaits its backward: the next step's start is no new step for the units' calls."""
        return self.phase.awaits_backward

    def _move(self, to: Phase) -> None:
        self.phase = to
        self.held, self.backward_running = to.held, to.backward_running

    def _refuse(self, transition: str) -> StepStateError:
        return StepStateError(f"lightning_shard: internal error: {transition} in phase {self.phase.label!r} (depth"
                              f" {self.depth}). Please report it, with the model's habit (a backward, a forward or"
                              " keep_gathered() where the engine did not expect one).")

    # -- scopes ---------------------------------------------------------------------------------------
    def start_step(self, joined_by_all: bool) -> None:
        """The outermost scope opens a step (once its start's work is done)."""
        to = _START_STEP.get(self.phase)
        if to is None or self.depth:
            raise self._refuse("a step's start")
        self.joined_by_all = joined_by_all
        self.depth = 1
        self._move(to)

    def nest(self) -> None:
        """A scope opens inside another, inside a backward (a recomputation), or inside keep_gathered()."""
        if self.phase not in _NESTS:
            raise self._refuse("a nested scope")
        self.depth += 1

    def close(self) -> None:
        """A scope closes; the outermost one of a step leaves it idle, or awaiting the backward of an earlier forward
        (what its own output awaits, :meth:`await_backward` says)."""
        if not self.depth:
            raise self._refuse("a scope's close")
        self.depth -= 1
        if not self.depth and self.phase in _CLOSE_LAST:
            self._move(_CLOSE_LAST[self.phase])

    def await_backward(self) -> None:
        """A forward's output awaits its backward, no scope open (the step's own output, or a unit called outside any
        step)."""
        to = _AWAIT.get(self.phase)
        if to is None:
            raise self._refuse("a forward awaiting its backward")
        self._move(to)

    # -- backward -------------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        to = _BEGIN_BACKWARD.get(self.phase)
        if to is None:
            raise self._refuse("a backward's start")
        self._move(to)

    def end_backward(self) -> None:
        """Its final callback ran, or it raised before it did (recovered at the next step's start)."""
        to = _END_BACKWARD.get(self.phase)
        if to is None:
            raise self._refuse("a backward's end")
        self._move(to[self.depth > 0])

    def keep_graph(self) -> None:
        """A ``create_graph=True`` backward ended: its graph may read the gathered buffers again."""
        self.graph_kept = True

    def drop_graph(self) -> None:
        """The kept graph is done with (an optimizer step changed the shards under it, or its backward failed)."""
        self.graph_kept = False

    # -- keep_gathered() -------------------------------------------------------------------------------
    def hold(self) -> None:
        to = _HOLD.get(self.phase)
        if to is None or self.depth:
            raise self._refuse("keep_gathered()'s hold")
        self._move(to)

    def release(self) -> None:
        to = _RELEASE.get(self.phase)
        if to is None:
            raise self._refuse("keep_gathered()'s release")
        self._move(to[self.depth > 0])

    # -- optimizer steps ------------------------------------------------------------------------------
    def optimizer_stepped(self) -> None:
        self.steps_done += 1
