"""One shared ``transitions`` Machine per kind of machine, fired on lightweight models.

Why not ``Machine(model=job)`` per job: ``add_model`` costs ~100 µs and scans a list (so n
live models cost O(n^2)), and a machine per object is worse. A trigger fired through the
shared machine's ``Event`` costs ~6 µs and needs nothing but a ``state`` attribute on the
model. So each kind of machine is declared once (states, transitions, guards) and every
job, reservation or device record is a plain object passed to :meth:`DeclaredMachine.fire`.

Firing: :meth:`~DeclaredMachine.fire` (the direct table where a transition has no
callbacks, else the engine), :meth:`~DeclaredMachine.fire_if_declared` (fire only if
declared from the current state; no may-then-fire), and
:meth:`~DeclaredMachine.fire_via_engine` (``transitions``' own ``Event.trigger`` only: the
reference that :mod:`calfsm.machines.equivalence` proves the table equal to).

Extension points: users attach their own callbacks without editing calfsm —
:meth:`DeclaredMachine.add_listener` for every state change, or ``on_enter``/``on_exit``
per state. Guards are named module-level predicates taking the ``EventData``.

Illegal triggers raise :class:`~calfsm.errors.IllegalTransition` naming the machine, the
state and the trigger (``transitions.MachineError`` carries only a string).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from transitions import EventData, Machine, MachineError

from calfsm.errors import IllegalTransition

__all__ = ["DeclaredMachine", "Listener", "StateModel"]


class StateModel(Protocol):
    """Anything with a ``state`` attribute can be driven by a declared machine."""

    state: str


#: ``listener(model, source, dest, trigger)`` runs after every state change.
Listener = Callable[[Any, str, str, str], None]

_CONTEXT = ("job_id", "seq_id", "generation")

#: a direct transition: (dest, guards) with guards () or (source State, Event,
#: Transition, conditions) -- what transitions would put into the guards' EventData
_Direct = tuple[str, tuple]


class DeclaredMachine:
    """A machine kind: its declaration (states, transitions, terminal states) and the one
    shared ``transitions.Machine`` that executes it."""

    def __init__(self, name: str, states: Sequence[str], transitions: Sequence[dict],
                 initial: str, terminal: Iterable[str]) -> None:
        self.name = name
        self.states: tuple[str, ...] = tuple(str(s) for s in states)
        self.declaration: tuple[dict, ...] = tuple(_plain(t) for t in transitions)
        self.initial = str(initial)
        self.terminal: frozenset[str] = frozenset(str(s) for s in terminal)
        self._listeners: list[Listener] = []
        self.machine = Machine(
            model=None, states=[str(s) for s in self.states],
            transitions=[dict(t) for t in self.declaration], initial=self.initial,
            auto_transitions=False, send_event=True, ignore_invalid_triggers=False,
            after_state_change=[self._notify], name=name)
        self._events = self.machine.events
        self.triggers: tuple[str, ...] = tuple(self._events)
        self._direct: dict[tuple[str, str], _Direct] = {}
        self.refresh()

    # ---- firing --------------------------------------------------------------------
    def fire(self, model: StateModel, trigger: str, *args: Any, **kwargs: Any) -> bool:
        """Fire ``trigger`` on ``model``.

        Returns False when a guard vetoed it (state unchanged); raises
        :class:`IllegalTransition` when the trigger is not declared from this state.

        A declared transition with no callback that ``transitions`` would have to run is
        *direct* (:meth:`is_direct`): its guards get the ``EventData`` the Machine would
        pass, then it is applied from the precomputed table (listeners still called),
        instead of through the Machine's event processing, which costs ~21x more per job
        lifecycle (``bench/bench_machines.py``). Anything else, and any call with
        arguments, goes through :meth:`fire_via_engine`;
        :func:`calfsm.machines.equivalence.check_engine_equivalence` proves both agree.
        """
        state = model.state
        direct = self._direct.get((state, trigger))
        if direct is not None and not args and not kwargs:
            if not direct[1] and not self._listeners:     # no guard, nobody listens
                model.state = direct[0]
                return True
            return self._apply(model, state, trigger, direct)
        return self.fire_via_engine(model, trigger, *args, **kwargs)

    def fire_if_declared(self, model: StateModel, trigger: str, *args: Any,
                         **kwargs: Any) -> bool:
        """Fire ``trigger`` if it is declared from the model's current state.

        True when it fired; False when it is not declared here or a guard vetoed it (the
        state is unchanged either way). One call instead of :meth:`may` then :meth:`fire`.
        """
        state = model.state
        direct = self._direct.get((state, trigger))
        if direct is not None and not args and not kwargs:
            if not direct[1] and not self._listeners:     # no guard, nobody listens
                model.state = direct[0]
                return True
            return self._apply(model, state, trigger, direct)
        event = self._events.get(trigger)
        if event is None or not event.transitions.get(state):
            return False
        return event.trigger(model, *args, **kwargs)

    def fire_via_engine(self, model: StateModel, trigger: str, *args: Any,
                        **kwargs: Any) -> bool:
        """Fire ``trigger`` through ``transitions``' own ``Event.trigger``, never the direct
        table: same contract as :meth:`fire`. ``transitions`` decides whether the trigger
        is valid here; its ``MachineError`` becomes :class:`IllegalTransition`."""
        state = model.state
        event = self._events.get(trigger)
        if event is None:
            raise self._illegal(model, state, trigger)
        try:
            return event.trigger(model, *args, **kwargs)
        except MachineError as err:
            if event.transitions.get(state):
                raise  # a callback's own error: the trigger itself was valid
            raise self._illegal(model, state, trigger) from err

    def _apply(self, model: StateModel, state: str, trigger: str, direct: _Direct) -> bool:
        """Check the guards of a direct transition, then apply it (see :meth:`fire`)."""
        dest, guards = direct
        if guards:
            src, event, transition, conditions = guards
            data = EventData(src, event, self.machine, model, (), {})
            data.transition = transition
            for cond in conditions:
                if not cond.check(data):
                    return False
        model.state = dest
        if self._listeners:
            for listener in tuple(self._listeners):
                listener(model, state, dest, trigger)
        return True

    def _illegal(self, model: StateModel, state: str, trigger: str) -> IllegalTransition:
        return IllegalTransition(self.name, state, trigger, **_context(model))

    def require(self, model: StateModel, trigger: str) -> None:
        """Raise :class:`IllegalTransition` unless ``trigger`` is declared from the model's
        current state (guards unchecked); fires nothing, changes nothing."""
        if not self.may(model, trigger):
            raise self._illegal(model, model.state, trigger)

    def is_direct(self, state: str, trigger: str) -> bool:
        """Whether :meth:`fire` applies ``trigger`` from ``state`` through the direct table."""
        return (str(state), trigger) in self._direct

    def refresh(self) -> None:
        """Recompute which transitions are direct (see :meth:`fire`). The callback methods
        of this class call it; call it yourself after changing ``self.machine`` directly
        (adding transitions, callbacks or machine-wide hooks)."""
        m = self.machine
        direct: dict[tuple[str, str], _Direct] = {}
        global_hooks = (m.prepare_event or m.finalize_event or m.before_state_change
                        or m.on_exception or m.on_final
                        or [c for c in m.after_state_change if c != self._notify])
        if not global_hooks:
            for trigger, event in m.events.items():
                for source, candidates in event.transitions.items():
                    if len(candidates) != 1:
                        continue
                    t = candidates[0]
                    if t.dest is None or t.prepare or t.before or t.after:
                        continue
                    src, dst = m.get_state(source), m.get_state(t.dest)
                    if src.on_exit or dst.on_enter or getattr(dst, "final", False):
                        continue
                    guards = (src, event, t, tuple(t.conditions)) if t.conditions else ()
                    direct[(source, trigger)] = (t.dest, guards)
        self._direct = direct

    def may(self, model: StateModel, trigger: str) -> bool:
        """Whether ``trigger`` is declared from the model's current state (guards unchecked)."""
        event = self._events.get(trigger)
        return event is not None and bool(event.transitions.get(model.state))

    def is_terminal(self, state: str) -> bool:
        return state in self.terminal

    def new_state(self) -> str:
        return self.initial

    # ---- extension points ----------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(model, source, dest, trigger)`` after every state change."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def on_enter(self, state: str, callback: Callable[[EventData], None]) -> None:
        """Run ``callback(event_data)`` whenever a model enters ``state``."""
        self.machine.get_state(str(state)).add_callback("enter", callback)
        self.refresh()

    def on_exit(self, state: str, callback: Callable[[EventData], None]) -> None:
        self.machine.get_state(str(state)).add_callback("exit", callback)
        self.refresh()

    def remove_state_callback(self, state: str, when: str,
                              callback: Callable[[EventData], None]) -> None:
        getattr(self.machine.get_state(str(state)), f"on_{when}").remove(callback)
        self.refresh()

    def _notify(self, event: EventData) -> None:
        if not self._listeners:
            return
        src = event.transition.source
        dst = event.transition.dest
        for listener in tuple(self._listeners):
            listener(event.model, src, dst, event.event.name)

    def __repr__(self) -> str:
        return f"<DeclaredMachine {self.name}: {len(self.states)} states, " \
               f"{len(self.triggers)} triggers>"


def _plain(transition: dict) -> dict:
    """A declaration row with enum members turned into their plain string values
    (``transitions`` keys Enum states by *name*, our models hold the value)."""
    row = dict(transition)
    for key in ("source", "dest"):
        value = row.get(key)
        if isinstance(value, list | tuple):
            row[key] = [str(v) for v in value]
        elif value is not None:
            row[key] = str(value)
    return row


def _context(model: Any) -> dict[str, Any]:
    return {k: getattr(model, k) for k in _CONTEXT if getattr(model, k, None) is not None}
