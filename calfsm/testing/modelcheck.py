"""Model-checking helpers for any ``transitions`` state machine.

Two tools, usable on a plain :class:`transitions.Machine` as well as on calfsm's
:class:`~calfsm.machines.DeclaredMachine` (whose ``.machine`` is used):

:func:`explore`
    An exhaustive, breadth-first walk over *states x triggers* of the declaration. Each
    guard (a ``conditions``/``unless`` entry) is treated as a free boolean: a guarded
    transition is explored both as taken and as vetoed, so the answer holds for every
    value the guards might return at run time. The result, an :class:`ExplorationReport`,
    lists unreachable states, states from which no terminal state can be reached
    (dead ends and closed loops), terminal states that are not absorbing, transitions
    that can never fire (shadowed by an earlier unguarded one), and the shortest trigger
    path to every reachable state. It reads the machine, it never fires it, so no model
    and no callback is involved.

:func:`fuzz_machine`
    A factory for a :class:`hypothesis.stateful.RuleBasedStateMachine` that fires random
    triggers, enabled and not, on a fresh model and checks after every step that an
    enabled trigger led to one of its declared destinations (or was vetoed by a guard
    and changed nothing), that a trigger not declared from the current state raised
    (``MachineError``, or :class:`~calfsm.errors.IllegalTransition` for a declared
    machine) and changed nothing, that a model never leaves a terminal state, and every
    invariant the caller supplies. Where the explorer proves properties of the
    *declaration*, the fuzzer tests the *running* machine with its real guards and
    callbacks. Use it as ``TestJob = fuzz_machine(JOB_MACHINE).TestCase``.

Why the explorer reads ``transitions`` internals: a ``Machine`` keeps its declaration
only in executable form — ``machine.events[trigger].transitions`` maps a source state to
the ordered list of :class:`transitions.Transition` objects that ``Event._process`` tries
in turn, each with its ``conditions`` (``Condition`` objects with ``func`` and
``target``) and its ``dest`` (``None`` for an internal transition). Wildcard sources
(``'*'``) and reflexive destinations (``'='``) are already expanded there, exactly as
they will execute, which is what a checker should look at.

Scope: flat machines. Nested (``HierarchicalMachine``) states are rejected with a
``TypeError`` rather than half-checked. Auto transitions (``to_<state>``, on by default
in ``transitions``) join every state to every other one and would make any machine look
sound, so :func:`explore` ignores them unless asked; :func:`fuzz_machine` fires only the
triggers you give it, by default every declared trigger except auto transitions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
from transitions import Machine, MachineError
from transitions.extensions.nesting import HierarchicalMachine

from calfsm.errors import IllegalTransition
from calfsm.machines import DeclaredMachine

if TYPE_CHECKING:
    import hypothesis
    from hypothesis.stateful import RuleBasedStateMachine

__all__ = [
    "Edge",
    "ExplorationReport",
    "MachineLike",
    "explore",
    "fuzz_machine",
]

#: What the helpers accept: a plain ``transitions`` machine or a calfsm declared machine.
MachineLike: TypeAlias = Machine | DeclaredMachine


# ---- the explorer --------------------------------------------------------------------

@attrs.frozen
class Edge:
    """One way a trigger can move a model: ``source --trigger [guards]--> dest``.

    ``guards`` names the guards that must all pass, in the order ``transitions`` checks
    them; an ``unless`` guard appears as ``"not <name>"``. ``internal`` marks a
    transition declared with ``dest=None`` (no exit/enter; ``dest`` is then the source).
    """

    source: str
    trigger: str
    dest: str
    guards: tuple[str, ...] = ()
    internal: bool = False

    def __str__(self) -> str:
        guard = f" [{' and '.join(self.guards)}]" if self.guards else ""
        return f"{self.source} --{self.trigger}{guard}--> {self.dest}"


@attrs.frozen
class ExplorationReport:
    """What :func:`explore` found. All state tuples are in declaration order.

    ``cannot_terminate`` covers every state, reachable or not: a state from which no
    sequence of triggers (with any guard outcomes) reaches a state of ``terminal``.
    ``shadowed`` lists declared transitions that can never fire because an earlier,
    unguarded transition of the same trigger and source always wins.
    """

    name: str
    initial: str
    states: tuple[str, ...]
    terminal: tuple[str, ...]
    edges: tuple[Edge, ...]
    reachable: tuple[str, ...]
    unreachable: tuple[str, ...]
    cannot_terminate: tuple[str, ...]
    non_absorbing_terminal: tuple[str, ...]
    shadowed: tuple[Edge, ...]
    paths: tuple[tuple[str, tuple[str, ...]], ...] = attrs.field(repr=False)

    def shortest_path(self, state: str | Enum) -> tuple[str, ...]:
        """The triggers of a shortest path from the initial state to ``state``.

        Ties are broken by declaration order (triggers in the order the machine
        declared them), so the answer is stable. Raises ``KeyError`` for a state that
        is unreachable or not declared.
        """
        name = _state_name(state)
        for s, path in self.paths:
            if s == name:
                return path
        why = "unreachable" if name in self.states else "not a state"
        raise KeyError(f"{name!r} is {why} in machine {self.name!r}")

    @property
    def problems(self) -> tuple[str, ...]:
        """Human-readable findings; empty for a sound machine."""
        out = []
        if self.unreachable:
            out.append(f"unreachable from {self.initial!r}: {', '.join(self.unreachable)}")
        if self.cannot_terminate:
            out.append(f"cannot reach a terminal state: {', '.join(self.cannot_terminate)}")
        if self.non_absorbing_terminal:
            out.append("terminal but not absorbing: "
                       + ", ".join(self.non_absorbing_terminal))
        out.extend(f"never fires (shadowed): {e}" for e in self.shadowed)
        return tuple(out)

    @property
    def ok(self) -> bool:
        return not self.problems

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` listing every problem (handy in a test)."""
        if self.problems:
            raise AssertionError(f"machine {self.name!r}: " + "; ".join(self.problems))


def explore(machine: MachineLike, *, terminal: Iterable[str | Enum] | None = None,
            initial: str | Enum | None = None,
            include_auto_transitions: bool = False) -> ExplorationReport:
    """Explore every state and trigger of ``machine`` breadth-first; see the module doc.

    ``terminal`` is the set of states a model is meant to end in. It defaults to the
    declared machine's ``terminal`` for a :class:`DeclaredMachine`, else to the states
    with no outgoing transition. ``initial`` defaults to the machine's initial state.
    """
    name, m = _unwrap(machine)
    if terminal is None and isinstance(machine, DeclaredMachine):
        terminal = machine.terminal
    states = tuple(m.states)
    start = _state_name(initial) if initial is not None else _state_name(m.initial)
    if start not in m.states:
        raise ValueError(f"machine {name!r} has no initial state {start!r}")

    edges, shadowed = _edges(m, include_auto_transitions)
    out: dict[str, list[Edge]] = {s: [] for s in states}
    into: dict[str, list[Edge]] = {s: [] for s in states}
    for e in edges:
        out[e.source].append(e)
        into[e.dest].append(e)

    if terminal is None:
        final = {s for s in states if not out[s]}
    else:
        final = {_state_name(s) for s in terminal}
        unknown = final - set(states)
        if unknown:
            raise ValueError(f"terminal states not in machine {name!r}: {sorted(unknown)}")

    # Forward: shortest paths from the initial state (BFS, declaration order).
    paths: dict[str, tuple[str, ...]] = {start: ()}
    queue = deque([start])
    while queue:
        s = queue.popleft()
        for e in out[s]:
            if e.dest not in paths:
                paths[e.dest] = (*paths[s], e.trigger)
                queue.append(e.dest)

    # Backward: which states have some path into the terminal set.
    live = set(final)
    queue = deque(final)
    while queue:
        s = queue.popleft()
        for e in into[s]:
            if e.source not in live:
                live.add(e.source)
                queue.append(e.source)

    def ordered(names: Iterable[str]) -> tuple[str, ...]:
        chosen = set(names)
        return tuple(s for s in states if s in chosen)

    return ExplorationReport(
        name=name, initial=start, states=states, terminal=ordered(final),
        edges=tuple(edges),
        reachable=ordered(paths), unreachable=ordered(set(states) - set(paths)),
        cannot_terminate=ordered(set(states) - live),
        non_absorbing_terminal=ordered(s for s in final if out[s]),
        shadowed=tuple(shadowed),
        paths=tuple((s, paths[s]) for s in states if s in paths))


def _unwrap(machine: MachineLike) -> tuple[str, Machine]:
    if isinstance(machine, DeclaredMachine):
        return machine.name, machine.machine
    if not isinstance(machine, Machine):
        raise TypeError(f"expected a transitions.Machine or DeclaredMachine, "
                        f"got {type(machine).__name__}")
    if isinstance(machine, HierarchicalMachine):  # keeps its declaration in another shape
        raise TypeError("hierarchical (nested) machines are not supported")
    return (machine.name.strip(": ") or type(machine).__name__), machine


def _state_name(state: Any) -> str:
    return state.name if isinstance(state, Enum) else str(state)


def _auto_names(m: Machine) -> set[str]:
    if not m.auto_transitions:
        return set()
    prefix = "to_" if m.model_attribute == "state" else f"to_{m.model_attribute}_"
    return {prefix + s for s in m.states}


def _guard_name(condition: Any) -> str:
    func = condition.func
    label = func if isinstance(func, str) else getattr(func, "__name__", repr(func))
    return label if condition.target else f"not {label}"


def _edges(m: Machine, include_auto: bool) -> tuple[list[Edge], list[Edge]]:
    """Every (source, trigger) outcome that moves or keeps a model, in declaration order.

    ``Event._process`` tries the transitions of a source in list order and stops at the
    first whose guards pass; a vetoed trigger leaves the state unchanged, which adds no
    edge. With guards free, transition ``i`` can fire unless an earlier transition of the
    same list has no guard (that one always wins): those later ones are *shadowed*.
    """
    skip = set() if include_auto else _auto_names(m)
    edges: list[Edge] = []
    shadowed: list[Edge] = []
    for trigger, event in m.events.items():
        if trigger in skip:
            continue
        for source, transitions in event.transitions.items():
            blocked = False
            for t in transitions:
                e = Edge(source=str(source), trigger=trigger,
                         dest=str(t.dest) if t.dest is not None else str(source),
                         guards=tuple(_guard_name(c) for c in t.conditions),
                         internal=t.dest is None)
                if blocked:
                    shadowed.append(e)
                    continue
                edges.append(e)
                blocked = not t.conditions
    order = {s: i for i, s in enumerate(m.states)}
    edges.sort(key=lambda e: order.get(e.source, len(order)))  # stable: triggers keep order
    return edges, shadowed


# ---- the fuzzer ----------------------------------------------------------------------

#: An invariant gets the model after every step; it fails by returning False or raising.
Invariant = Callable[[Any], object]


def fuzz_machine(
    machine: MachineLike,
    *,
    make_model: Callable[[], Any] | None = None,
    invariants: Iterable[Invariant] = (),
    actions: Mapping[str, Callable[[Any], None]] | None = None,
    triggers: Sequence[str] | None = None,
    terminal: Iterable[str | Enum] | None = None,
    settings: hypothesis.settings | None = None,
) -> type[RuleBasedStateMachine]:
    """Build a hypothesis rule-based test that fires random triggers on a fresh model.

    Every example starts from ``make_model()`` — by default a bare object whose
    ``state`` is the initial state (a declared machine) or an object added to the
    plain machine with ``add_model`` (and removed again in ``teardown``, so the shared
    machine does not accumulate models). Each step fires one trigger, chosen either
    among those declared from the current state or among all ``triggers``, and checks:

    * an enabled trigger that returned True left the model in a destination declared
      for this (source, trigger); one that returned False (a guard vetoed it) left the
      state unchanged;
    * a trigger not declared from the current state raised ``MachineError`` (plain
      machine; it returns False instead if the machine or state ignores invalid
      triggers) or :class:`~calfsm.errors.IllegalTransition` naming machine, state and
      trigger (declared machine) — and left the state unchanged;
    * the state is a declared state, and a model that reached a ``terminal`` state
      (default: the declared machine's terminal states; none for a plain machine)
      never leaves it;
    * every callable of ``invariants`` holds (``inv(model)`` must not return False or
      raise).

    ``actions`` are extra named steps that change the model outside the machine, e.g.
    ``{"cancel": lambda job: setattr(job, "cancel_requested", True)}``, so guards that
    read the model are exercised both ways. ``settings`` is applied to ``.TestCase``.
    Usage in a test module::

        TestJobMachine = fuzz_machine(JOB_MACHINE, invariants=[...]).TestCase
    """
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    name, m = _unwrap(machine)
    declared = machine if isinstance(machine, DeclaredMachine) else None
    all_triggers = tuple(triggers) if triggers is not None else tuple(
        t for t in m.events if t not in _auto_names(m))
    unknown = [t for t in all_triggers if t not in m.events]
    if unknown:
        raise ValueError(f"machine {name!r} declares no trigger(s) {unknown}")
    if not all_triggers:
        raise ValueError(f"machine {name!r} has no triggers to fire")
    if terminal is None:
        terminal = declared.terminal if declared is not None else ()
    final = frozenset(_state_name(s) for s in terminal)
    checks = tuple(invariants)
    extra = dict(actions or {})

    def new_model() -> Any:
        if make_model is not None:
            return make_model()
        if declared is not None:
            return SimpleNamespace(state=declared.new_state())
        return SimpleNamespace()

    def state_of(model: Any) -> str:
        return m.get_model_state(model).name

    def enabled(model: Any) -> list[str]:
        s = state_of(model)
        return [t for t in all_triggers if m.events[t].transitions.get(s)]

    def ignores_invalid(state: str) -> bool:
        flag = m.get_state(state).ignore_invalid_triggers
        return bool(m.ignore_invalid_triggers if flag is None else flag)

    class Fuzz(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = new_model()
            self.added = declared is None and self.model not in m.models
            if self.added:
                m.add_model(self.model)
            self.ended_in: str | None = None

        def teardown(self) -> None:
            if self.added:
                m.remove_model(self.model)

        def _fire(self, trigger: str) -> Any:
            if declared is not None:
                return declared.fire(self.model, trigger)
            return m.events[trigger].trigger(self.model)

        def _step(self, trigger: str) -> None:
            before = state_of(self.model)
            declared_here = m.events[trigger].transitions.get(before)
            if declared_here:
                result = self._fire(trigger)
                after = state_of(self.model)
                allowed = {str(t.dest) if t.dest is not None else before
                           for t in declared_here}
                if result:
                    assert after in allowed, (
                        f"{name}: {trigger!r} from {before!r} went to {after!r}, "
                        f"declared destinations are {sorted(allowed)}")
                else:
                    assert after == before, (
                        f"{name}: {trigger!r} from {before!r} was vetoed but the state "
                        f"changed to {after!r}")
                return
            if declared is not None:
                try:
                    self._fire(trigger)
                except IllegalTransition as e:
                    assert (e.machine, e.state, e.trigger) == (name, before, trigger), (
                        f"IllegalTransition names {(e.machine, e.state, e.trigger)}, "
                        f"expected {(name, before, trigger)}")
                else:
                    raise AssertionError(
                        f"{name}: {trigger!r} is not declared from {before!r} "
                        "but did not raise IllegalTransition")
            elif ignores_invalid(before):
                assert not self._fire(trigger), (
                    f"{name}: ignored invalid trigger {trigger!r} from {before!r} "
                    "returned True")
            else:
                try:
                    self._fire(trigger)
                except MachineError:
                    pass
                else:
                    raise AssertionError(
                        f"{name}: {trigger!r} is not declared from {before!r} "
                        "but did not raise MachineError")
            after = state_of(self.model)
            assert after == before, (
                f"{name}: refused trigger {trigger!r} moved {before!r} to {after!r}")

        @precondition(lambda self: bool(enabled(self.model)))
        @rule(data=st.data())
        def fire_enabled(self, data: st.DataObject) -> None:
            self._step(data.draw(st.sampled_from(enabled(self.model)), label="trigger"))

        @rule(trigger=st.sampled_from(all_triggers))
        def fire_any(self, trigger: str) -> None:
            self._step(trigger)

        if extra:
            @rule(action=st.sampled_from(sorted(extra)))
            def act(self, action: str) -> None:
                extra[action](self.model)

        @invariant()
        def model_invariants(self) -> None:
            s = state_of(self.model)
            assert s in m.states, f"{name}: model is in undeclared state {s!r}"
            if self.ended_in is not None:
                assert s == self.ended_in, (
                    f"{name}: model left terminal state {self.ended_in!r} for {s!r}")
            elif s in final:
                self.ended_in = s
            for inv in checks:
                ok = inv(self.model)
                assert ok is not False, (
                    f"{name}: invariant {getattr(inv, '__name__', inv)!r} failed "
                    f"in state {s!r}")

    Fuzz.__name__ = Fuzz.__qualname__ = f"Fuzz_{name}"
    if settings is not None:
        Fuzz.TestCase.settings = settings
    return Fuzz
