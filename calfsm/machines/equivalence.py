"""Proof that a declared machine's direct table does what ``transitions`` would do.

:meth:`DeclaredMachine.fire` applies callback-free transitions from a precomputed table
instead of running ``transitions``' ``Event.trigger``. :func:`check_engine_equivalence`
fires every state x every trigger (and one name that is no trigger) x every outcome of
the guards on that pair (each forced to pass, veto or raise) on fresh models, through
:meth:`~DeclaredMachine.fire`, :meth:`~DeclaredMachine.fire_if_declared` and
:meth:`~DeclaredMachine.fire_via_engine`, and compares what each did: the return value or
the exception (class, and for :class:`IllegalTransition` its machine, state, trigger and
context), the resulting state, the listener calls and what every guard was shown (the
``EventData``'s state, event, transition, model, arguments). The engine is the reference;
``fire_if_declared`` must match it except that an undeclared trigger returns False.

Guards are forced by wrapping each ``Condition`` of the machine for the duration of the
check; the wrappers force only the checker's own models and pass every other model to the
real guard, so the machine stays usable by other threads meanwhile.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import attrs
from transitions import EventData
from transitions.core import Condition

from calfsm.errors import IllegalTransition, Internal
from calfsm.machines._declared import DeclaredMachine

__all__ = ["GUARD_OUTCOMES", "UNDECLARED_TRIGGER", "EquivalenceReport", "ForcedGuardError",
           "check_engine_equivalence"]

#: what a forced guard does: let the transition through, veto it, or raise
GUARD_OUTCOMES = ("pass", "veto", "raise")

#: a trigger name no machine declares; every path must refuse it
UNDECLARED_TRIGGER = "__undeclared_trigger__"

#: context fields of every model the checker fires, so IllegalTransition carries them
_MODEL_CONTEXT = {"job_id": 11, "seq_id": 7, "generation": 3}


class ForcedGuardError(Internal):
    """Raised by a guard that the checker forced to raise."""


@attrs.frozen
class EquivalenceReport:
    """What :func:`check_engine_equivalence` fired and where the paths disagreed."""

    machine: str
    #: (state, trigger, guard outcomes, model attributes) combinations fired on each path
    cases: int
    #: every (state, trigger) pair the machine declares
    declared: tuple[tuple[str, str], ...]
    #: the declared pairs that :meth:`DeclaredMachine.fire` takes through the direct table
    direct: tuple[tuple[str, str], ...]
    #: one line per disagreeing case and path; empty when the paths are equivalent
    mismatches: tuple[str, ...]


class _Probe:
    """The checker's instrumentation: which models are its own, the outcome forced on each
    guard, and what guards and listeners saw during the current firing."""

    def __init__(self, machine: DeclaredMachine) -> None:
        self.engine = machine.machine
        self.model: Any = None
        self.forced: dict[int, str] | None = None  # id(Condition) -> outcome
        self.seen: list[tuple] = []

    def guard(self, cond: Condition, real: Any) -> Callable[[EventData], Any]:
        name = f"{getattr(real, '__name__', real)}@{id(cond):x}"

        def checked(event: EventData) -> Any:
            if event.model is not self.model:  # not ours: the real guard, untouched
                return event.machine.resolve_callable(real, event)(event)
            transition = event.transition
            self.seen.append((f"guard {name}", event.state.name, event.event.name,
                              None if transition is None
                              else (transition.source, transition.dest),
                              "engine" if event.machine is self.engine else event.machine,
                              event.args, dict(event.kwargs)))
            if self.forced is None:
                return event.machine.resolve_callable(real, event)(event)
            outcome = self.forced[id(cond)]
            if outcome == "raise":
                raise ForcedGuardError(f"guard {name} forced to raise")
            return cond.target if outcome == "pass" else not cond.target
        return checked

    def listener(self, model: Any, source: str, dest: str, trigger: str) -> None:
        if model is self.model:
            self.seen.append(("listener", source, dest, trigger))


def check_engine_equivalence(machine: DeclaredMachine, *, force_guards: bool = True,
                             variants: Sequence[Mapping[str, Any]] = ({},),
                             ) -> EquivalenceReport:
    """Fire every case on every path and compare (see the module docstring).

    With ``force_guards`` each guard is forced through :data:`GUARD_OUTCOMES`; without
    it the real guards run on models carrying each of ``variants``' attributes (e.g.
    ``{"cancel_requested": True}``), which checks that they see the same ``EventData``.
    """
    engine = machine.machine
    conditions = {(source, trigger): [c for t in candidates for c in t.conditions]
                  for trigger, event in engine.events.items()
                  for source, candidates in event.transitions.items()}
    probe = _Probe(machine)
    cases = 0
    mismatches: list[str] = []
    with _instrumented(machine, probe, [c for cs in conditions.values() for c in cs]):
        for state in machine.states:
            for trigger in (*machine.triggers, UNDECLARED_TRIGGER):
                conds = conditions.get((state, trigger), [])
                outcomes = (itertools.product(GUARD_OUTCOMES, repeat=len(conds))
                            if force_guards else [None])
                for forced, attrs_ in itertools.product(outcomes, variants):
                    cases += 1
                    probe.forced = (None if forced is None
                                    else {id(c): o for c, o in zip(conds, forced, strict=True)})
                    mismatches += _compare(machine, probe, state, trigger, attrs_,
                                           f"{state} --{trigger}--> guards {forced} "
                                           f"attrs {dict(attrs_)}")
    declared = tuple(sorted(conditions))
    return EquivalenceReport(
        machine=machine.name, cases=cases, declared=declared,
        direct=tuple(p for p in declared if machine.is_direct(*p)),
        mismatches=tuple(mismatches))


def _compare(machine: DeclaredMachine, probe: _Probe, state: str, trigger: str,
             attrs_: Mapping[str, Any], case: str) -> list[str]:
    def run(fire: Callable[..., bool]) -> tuple:
        probe.model = SimpleNamespace(state=state, **_MODEL_CONTEXT, **attrs_)
        probe.seen = []
        try:
            outcome: tuple = ("returned", fire(probe.model, trigger))
        except Exception as err:  # any exception is an outcome to compare
            outcome = ("raised", *_describe(err))
        result = (*outcome, probe.model.state, tuple(probe.seen))
        probe.model = None
        return result

    want = run(machine.fire_via_engine)
    refused = want[:2] == ("raised", IllegalTransition)
    want_if = ("returned", False, state, ()) if refused else want
    out = []
    for name, fire, expected in (("fire", machine.fire, want),
                                 ("fire_if_declared", machine.fire_if_declared, want_if)):
        got = run(fire)
        if got != expected:
            out.append(f"{machine.name}: {case}: {name} gave {got}, expected {expected}")
    return out


def _describe(err: Exception) -> tuple:
    if isinstance(err, IllegalTransition):
        return (IllegalTransition, err.machine, err.state, err.trigger, err.context())
    return (type(err), str(err))


@contextmanager
def _instrumented(machine: DeclaredMachine, probe: _Probe,
                  conds: list[Condition]) -> Iterator[None]:
    """Wrap the guards ``conds`` of ``machine`` and listen to it for the duration."""
    real = [c.func for c in conds]
    machine.add_listener(probe.listener)
    try:
        for c, func in zip(conds, real, strict=True):
            c.func = probe.guard(c, func)
        yield
    finally:
        for c, func in zip(conds, real, strict=True):
            c.func = func
        machine.remove_listener(probe.listener)
