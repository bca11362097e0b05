"""The step's state (engine/runtime/step_state.py): one enum-typed phase, changed only by its transitions, each
checked against the phases it may start from."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_shard.engine.runtime.step_state import Phase, StepState, StepStateError

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_shard"


def _walk(state: StepState, moves: list[str]) -> list[str]:
    """Each move (a transition, with ``start_step`` joined) and the phase it leads to."""
    phases = []
    for move in moves:
        getattr(state, move)(*((True,) if move == "start_step" else ()))
        phases.append(state.phase.name)
    return phases


def test_the_phases_of_the_usual_steps():
    # Lightning's automatic optimization: the step's forward, its loss's backward after it
    assert _walk(StepState(), ["start_step", "close", "await_backward", "begin_backward", "end_backward"]) == [
        "FORWARD", "IDLE", "AWAITING_BACKWARD", "BACKWARD", "IDLE"]
    # manual optimization: the backward inside the step, the step's scope still open after it
    assert _walk(StepState(), ["start_step", "begin_backward", "end_backward", "close"]) == [
        "FORWARD", "BACKWARD", "FORWARD", "IDLE"]
    # model(a) + model(b): the second forward starts while the first one's output awaits its backward
    assert _walk(StepState(), ["start_step", "close", "await_backward", "start_step", "close", "begin_backward",
                               "end_backward"]) == [
        "FORWARD", "IDLE", "AWAITING_BACKWARD", "FORWARD_AGAIN", "AWAITING_BACKWARD", "BACKWARD", "IDLE"]
    # keep_gathered() with forwards inside, entered while a graph awaits its backward: it awaits it after
    state = StepState()
    assert _walk(state, ["await_backward", "hold", "nest", "close", "release"]) == [
        "AWAITING_BACKWARD", "HELD_AWAITING", "HELD_AWAITING", "HELD_AWAITING", "AWAITING_BACKWARD"]
    assert (state.held, state.backward_running, state.depth) == (False, False, 0)


def test_the_hooks_flags_follow_the_phase():
    state = StepState()
    state.hold()
    state.begin_backward()  # an earlier graph's backward inside keep_gathered()
    assert state.phase is Phase.HELD_BACKWARD and state.held and state.backward_running
    state.end_backward()
    assert state.phase is Phase.HELD and state.held and not state.backward_running


@pytest.mark.parametrize("moves, refused", [
    ([], "close"),  # no scope open
    (["start_step"], "start_step"),  # a step inside a step is a nested scope
    (["start_step"], "hold"),  # keep_gathered() inside a step
    (["begin_backward"], "begin_backward"),  # a backward begins once
    ([], "end_backward"),  # no backward ran
    ([], "release"),  # nothing held
    ([], "nest"),  # a scope nests inside another
    (["start_step"], "await_backward"),  # a scope is open: its close says what awaits
])
def test_a_transition_from_a_phase_it_may_not_start_from_is_an_error(moves, refused):
    state = StepState()
    _walk(state, moves)
    before = (state.phase, state.depth)
    with pytest.raises(StepStateError, match="internal error"):
        getattr(state, refused)(*((True,) if refused == "start_step" else ()))
    assert (state.phase, state.depth) == before  # (nothing changed)


def test_only_step_state_py_assigns_the_steps_state():
    """``state.phase = ...`` (or its depth, its flags) anywhere but step_state.py would be a transition unchecked."""
    fields = set(StepState.__slots__)
    written = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "step_state.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    owner = t.value if isinstance(t, ast.Attribute) else None
                    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
                    if t is not None and isinstance(t, ast.Attribute) and t.attr in fields and name == "state":
                        written.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not written, written
