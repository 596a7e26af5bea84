"""calfsm.testing on hand-made plain ``transitions`` machines: the explorer must find
planted defects, and the fuzzer must fail on planted bugs (a checker that cannot fail
checks nothing)."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from transitions import Machine
from transitions.extensions import HierarchicalMachine

from calfsm.errors import IllegalTransition
from calfsm.machines import DeclaredMachine
from calfsm.testing import Edge, explore, fuzz_machine

QUICK = settings(max_examples=80, stateful_step_count=25, database=None,
                 suppress_health_check=list(HealthCheck))


def never(event) -> bool:
    """A guard that is False at run time: the explorer must still follow it."""
    return False


def flaky(event) -> bool:
    return getattr(event.model, "ok", False)


def broken_machine(**kwargs) -> Machine:
    """idle -> running -> done is fine; ``orphan`` cannot be reached; ``stuck`` and
    ``loop`` form a closed loop with no way out; ``limbo`` is a sink."""
    return Machine(
        model=None, auto_transitions=False, send_event=True, initial="idle",
        states=["idle", "running", "done", "orphan", "stuck", "loop", "limbo"],
        transitions=[
            {"trigger": "go", "source": "idle", "dest": "running"},
            {"trigger": "finish", "source": "running", "dest": "done"},
            {"trigger": "wedge", "source": "running", "dest": "stuck"},
            {"trigger": "spin", "source": "stuck", "dest": "loop"},
            {"trigger": "spin", "source": "loop", "dest": "stuck"},
            {"trigger": "lose", "source": "running", "dest": "limbo",
             "conditions": [never]},
            {"trigger": "finish", "source": "orphan", "dest": "done"},
        ], **kwargs)


# ---- explorer ------------------------------------------------------------------------

def test_explorer_finds_unreachable_and_dead_end_states() -> None:
    report = explore(broken_machine(), terminal=["done"])
    assert report.unreachable == ("orphan",)
    # limbo is a sink that is not terminal; stuck/loop cycle forever.
    assert report.cannot_terminate == ("stuck", "loop", "limbo")
    assert report.non_absorbing_terminal == ()
    assert not report.ok
    with pytest.raises(AssertionError, match="orphan"):
        report.assert_ok()
    assert any("cannot reach a terminal state: stuck, loop, limbo" in p
               for p in report.problems)


def test_default_terminal_set_is_the_sinks() -> None:
    report = explore(broken_machine())
    assert report.terminal == ("done", "limbo")
    assert report.cannot_terminate == ("stuck", "loop")


def test_guards_are_free_booleans() -> None:
    # ``lose`` is guarded by a predicate that is always False at run time; as a free
    # boolean it is explored as taken, so limbo is reachable.
    report = explore(broken_machine())
    assert "limbo" in report.reachable
    assert report.shortest_path("limbo") == ("go", "lose")
    assert Edge("running", "lose", "limbo", ("never",)) in report.edges


def test_unless_guard_is_named_negated() -> None:
    m = Machine(model=None, auto_transitions=False, initial="a", states=["a", "b"],
                transitions=[{"trigger": "t", "source": "a", "dest": "b",
                              "conditions": "ready", "unless": [never]}])
    (edge,) = explore(m).edges
    assert edge.guards == ("ready", "not never")
    assert str(edge) == "a --t [ready and not never]--> b"


def test_shortest_path_and_errors() -> None:
    report = explore(broken_machine())
    assert report.shortest_path("idle") == ()
    assert report.shortest_path("loop") == ("go", "wedge", "spin")
    with pytest.raises(KeyError, match="unreachable"):
        report.shortest_path("orphan")
    with pytest.raises(KeyError, match="not a state"):
        report.shortest_path("nowhere")


def test_shortest_path_ties_follow_declaration_order() -> None:
    m = Machine(model=None, auto_transitions=False, initial="a", states=["a", "b", "c"],
                transitions=[["second", "a", "b"], ["first", "a", "b"], ["on", "b", "c"]])
    assert explore(m).shortest_path("c") == ("second", "on")


def test_unguarded_transition_shadows_later_ones() -> None:
    m = Machine(model=None, auto_transitions=False, initial="a", states=["a", "b", "c"],
                transitions=[["t", "a", "b"], ["t", "a", "c"]])
    report = explore(m)
    assert report.shadowed == (Edge("a", "t", "c"),)
    assert report.unreachable == ("c",)
    assert "never fires (shadowed): a --t--> c" in report.problems


def test_guarded_transition_does_not_shadow_its_fallback() -> None:
    m = Machine(model=None, auto_transitions=False, initial="a", states=["a", "b", "c"],
                transitions=[{"trigger": "t", "source": "a", "dest": "b",
                              "conditions": [flaky]},
                             ["t", "a", "c"]])
    report = explore(m)
    assert report.shadowed == ()
    assert report.reachable == ("a", "b", "c")


def test_wildcard_source_makes_terminal_non_absorbing() -> None:
    m = Machine(model=None, auto_transitions=False, initial="a",
                states=["a", "b", "aborted"],
                transitions=[["t", "a", "b"], ["abort", "*", "aborted"]])
    report = explore(m, terminal=["b", "aborted"])
    # '*' was expanded to every state, aborted included.
    assert {e.source for e in report.edges if e.trigger == "abort"} == {"a", "b", "aborted"}
    assert report.non_absorbing_terminal == ("b", "aborted")
    assert report.cannot_terminate == ()


def test_internal_and_reflexive_transitions() -> None:
    m = Machine(model=None, auto_transitions=False, initial="a", states=["a", "b"],
                transitions=[{"trigger": "poke", "source": "a", "dest": None},
                             {"trigger": "again", "source": "a", "dest": "="},
                             ["t", "a", "b"]])
    report = explore(m)
    assert Edge("a", "poke", "a", internal=True) in report.edges
    assert Edge("a", "again", "a") in report.edges
    assert report.terminal == ("b",)


def test_auto_transitions_are_ignored_unless_asked() -> None:
    m = Machine(model=None, initial="a", states=["a", "b", "c"], transitions=[["t", "a", "b"]])
    assert explore(m).unreachable == ("c",)
    assert explore(m, include_auto_transitions=True).unreachable == ()


def test_enum_states() -> None:
    class S(enum.Enum):
        A = 1
        B = 2

    m = Machine(model=None, states=S, initial=S.A, auto_transitions=False,
                transitions=[["t", S.A, S.B]])
    report = explore(m)
    assert report.reachable == ("A", "B")
    assert report.shortest_path(S.B) == ("t",)


def test_explorer_rejects_what_it_cannot_check() -> None:
    with pytest.raises(TypeError, match="hierarchical"):
        explore(HierarchicalMachine(model=None, states=["a"], initial="a"))
    with pytest.raises(TypeError):
        explore(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nowhere"):
        explore(broken_machine(), terminal=["nowhere"])


def test_report_is_frozen() -> None:
    report = explore(broken_machine())
    with pytest.raises(AttributeError):
        report.unreachable = ()  # type: ignore[misc]


# ---- fuzzer --------------------------------------------------------------------------

def door(**kwargs) -> Machine:
    """A plain machine: closed <-> open, closed -> locked (guarded) -> closed, and
    anything but locked -> broken (terminal)."""
    return Machine(
        model=None, auto_transitions=False, send_event=True, initial="closed",
        states=["closed", "open", "locked", "broken"],
        transitions=[
            ["open", "closed", "open"],
            ["close", "open", "closed"],
            {"trigger": "lock", "source": "closed", "dest": "locked",
             "conditions": [flaky]},
            ["unlock", "locked", "closed"],
            ["smash", ["closed", "open"], "broken"],
        ], **kwargs)


def test_fuzzer_passes_a_sound_machine_and_visits_every_state() -> None:
    m = door()
    seen: set[str] = set()

    def record(model) -> bool:
        seen.add(model.state)
        return True

    fuzz = fuzz_machine(m, invariants=[record], terminal=["broken"],
                        actions={"allow": lambda d: setattr(d, "ok", True)})
    run_state_machine_as_test(fuzz, settings=QUICK)
    assert seen == {"closed", "open", "locked", "broken"}
    assert m.models == []  # every example's model was removed again


def test_fuzzer_accepts_machines_that_ignore_invalid_triggers() -> None:
    run_state_machine_as_test(fuzz_machine(door(ignore_invalid_triggers=True)),
                              settings=QUICK)


def test_fuzzer_catches_a_failing_invariant() -> None:
    fuzz = fuzz_machine(door(), invariants=[lambda d: d.state != "open"])
    with pytest.raises(AssertionError, match="invariant '<lambda>' failed in state 'open'"):
        run_state_machine_as_test(fuzz, settings=QUICK)


def test_fuzzer_catches_an_undeclared_destination() -> None:
    def teleport(event) -> None:  # a buggy callback that overwrites the state
        event.model.state = "locked"

    m = door()
    m.events["open"].add_callback("after", teleport)
    with pytest.raises(AssertionError, match="went to 'locked'"):
        run_state_machine_as_test(fuzz_machine(m), settings=QUICK)


def test_fuzzer_catches_leaving_a_terminal_state() -> None:
    m = door()
    m.add_transition("repair", "broken", "closed")
    with pytest.raises(AssertionError, match="left terminal state 'broken'"):
        run_state_machine_as_test(fuzz_machine(m, terminal=["broken"]), settings=QUICK)


class Lenient(DeclaredMachine):
    """A declared machine whose fire() swallows illegal triggers (the bug to catch)."""

    def fire(self, model, trigger, *args, **kwargs):
        try:
            return super().fire(model, trigger, *args, **kwargs)
        except IllegalTransition:
            return False


def test_fuzzer_catches_a_declared_machine_that_does_not_raise() -> None:
    m = Lenient("lenient", ["a", "b"], [{"trigger": "t", "source": "a", "dest": "b"},
                                        {"trigger": "u", "source": "b", "dest": "a"}],
                initial="a", terminal=[])
    with pytest.raises(AssertionError, match="did not raise IllegalTransition"):
        run_state_machine_as_test(fuzz_machine(m), settings=QUICK)


def test_fuzzer_argument_errors() -> None:
    with pytest.raises(ValueError, match="nope"):
        fuzz_machine(door(), triggers=["open", "nope"])
    empty = Machine(model=None, states=["a"], initial="a", auto_transitions=False)
    with pytest.raises(ValueError, match="no triggers"):
        fuzz_machine(empty)


def test_fuzzer_uses_the_given_model_factory() -> None:
    made: list[SimpleNamespace] = []

    def make() -> SimpleNamespace:
        made.append(SimpleNamespace(ok=True))
        return made[-1]

    run_state_machine_as_test(fuzz_machine(door(), make_model=make),
                              settings=settings(QUICK, max_examples=5))
    assert made and all(d.state in {"closed", "open", "locked", "broken"} for d in made)


def test_the_package_imports_without_pytest_or_hypothesis() -> None:
    import subprocess
    import sys
    code = ("import sys; sys.modules['pytest'] = sys.modules['hypothesis'] = None; "
            "import calfsm.testing, calfsm.testing.refmodel_pure; "
            "from calfsm.testing import Edge, ExplorationReport, MachineLike, explore, "
            "fuzz_machine; print(sorted(m for m in sys.modules if m.startswith('calfsm.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['calfsm.testing',", "'calfsm.testing.modelcheck',",
                                  "'calfsm.testing.refmodel_pure']"]
