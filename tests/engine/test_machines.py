"""The three declared machines: model-checked exhaustively, fuzzed, and their extension
points (listeners, on_enter/on_exit, guards) exercised on the shared machines.

Everything that registers a callback on a shared machine removes it in ``finally``: the
machines are process-wide and other suites fire them too.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from transitions import MachineError
from transitions.core import Condition

from calfsm.errors import IllegalTransition
from calfsm.machines import (
    ALL_MACHINES,
    FLOW_MACHINE,
    JOB_MACHINE,
    KV_MACHINE,
    LIFECYCLE_MACHINE,
    DeclaredMachine,
    JobState,
    KvState,
    LifecycleState,
)
from calfsm.machines.equivalence import GUARD_OUTCOMES, check_engine_equivalence
from calfsm.machines.job import deliverable
from calfsm.testing import explore, fuzz_machine

FUZZ = settings(max_examples=60, stateful_step_count=30,
                suppress_health_check=list(HealthCheck))


def model(machine: DeclaredMachine, **attrs: object) -> SimpleNamespace:
    return SimpleNamespace(state=machine.new_state(), **attrs)


# ---- exhaustive exploration ----------------------------------------------------------

@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_machine_is_sound(machine: DeclaredMachine) -> None:
    report = explore(machine)
    assert report.unreachable == ()
    assert report.cannot_terminate == ()
    assert report.non_absorbing_terminal == ()
    assert report.shadowed == ()
    assert report.reachable == machine.states


@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_declared_terminal_states_are_exactly_the_sinks(machine: DeclaredMachine) -> None:
    # With no terminal set given, the explorer takes the states without outgoing
    # transitions; the declaration must name exactly those as terminal, no more, no less.
    sinks = explore(machine.machine).terminal
    assert set(sinks) == set(machine.terminal)


@pytest.mark.parametrize(("machine", "state", "path"), [
    (JOB_MACHINE, JobState.SUCCEEDED,
     ("admit", "prepare", "enqueue", "submit", "complete", "succeed")),
    (JOB_MACHINE, JobState.CANCEL_REQUESTED, ("cancel",)),
    (JOB_MACHINE, JobState.QUARANTINED, ("admit", "prepare", "enqueue", "submit",
                                         "quarantine")),
    (KV_MACHINE, KvState.COMMITTED, ("mark_submitted", "commit")),
    (KV_MACHINE, KvState.RESERVED, ()),
    (LIFECYCLE_MACHINE, LifecycleState.READY, ("start", "configured", "warmed")),
    # a failed first bring-up retries through Recovering (reset, new generation)
    (LIFECYCLE_MACHINE, LifecycleState.RECOVERING, ("start", "retry")),
], ids=lambda v: getattr(v, "name", None) if isinstance(v, DeclaredMachine) else None)
def test_shortest_paths(machine: DeclaredMachine, state: str, path: tuple[str, ...]) -> None:
    report = explore(machine)
    assert report.shortest_path(state.value) == path
    # ...and the path really drives the running machine there.
    m = model(machine, known_good=None, cancel_requested=False)
    for trigger in path:
        assert machine.fire(m, trigger) is True
    assert m.state == state


def test_submitted_job_leaves_only_through_wait_or_recovery() -> None:
    # Architecture: "A job in Submitted leaves only through its Wait() result or through
    # recovery" -- in particular neither cancel nor fail may be declared from Submitted.
    report = explore(JOB_MACHINE)
    out = {(e.trigger, e.dest) for e in report.edges if e.source == JobState.SUBMITTED}
    assert out == {("complete", JobState.COMPLETING), ("quarantine", JobState.QUARANTINED)}


def test_kv_never_claims_rollback_after_submit() -> None:
    report = explore(KV_MACHINE)
    into_rolled_back = {e.source for e in report.edges if e.dest == KvState.ROLLED_BACK}
    assert into_rolled_back == {KvState.RESERVED}


# ---- random firing -------------------------------------------------------------------

def _request_cancel(job: SimpleNamespace) -> None:
    # JobHandle.cancel on a finished job changes nothing; before that it sets the flag.
    if not JOB_MACHINE.is_terminal(job.state):
        job.cancel_requested = True


def cancelled_job_never_succeeds(job: SimpleNamespace) -> bool:
    return not (job.cancel_requested and job.state == JobState.SUCCEEDED)


TestJobMachine = fuzz_machine(
    JOB_MACHINE, make_model=lambda: model(JOB_MACHINE, cancel_requested=False),
    actions={"request_cancel": _request_cancel},
    invariants=[cancelled_job_never_succeeds], settings=FUZZ).TestCase

TestKvMachine = fuzz_machine(KV_MACHINE, settings=FUZZ).TestCase


def _set_known_good(device: SimpleNamespace) -> None:
    device.known_good = 1


def _forget_known_good(device: SimpleNamespace) -> None:
    device.known_good = None


def state_is_a_plain_string(device: SimpleNamespace) -> bool:
    # Models hold the state's string value (never the enum member or a State object),
    # which is what the rest of calfsm compares against.
    return isinstance(device.state, str) and device.state in LIFECYCLE_MACHINE.states


TestLifecycleMachine = fuzz_machine(
    LIFECYCLE_MACHINE, make_model=lambda: model(LIFECYCLE_MACHINE, known_good=None),
    actions={"known_good": _set_known_good, "forget": _forget_known_good},
    invariants=[state_is_a_plain_string], settings=FUZZ).TestCase


# ---- illegal triggers and terminal states --------------------------------------------

def test_illegal_trigger_names_machine_state_and_trigger() -> None:
    job = model(JOB_MACHINE, job_id=7, seq_id=3, generation=2)
    with pytest.raises(IllegalTransition) as info:
        JOB_MACHINE.fire(job, "succeed")
    err = info.value
    assert (err.machine, err.state, err.trigger) == ("job", "Created", "succeed")
    assert (err.job_id, err.seq_id, err.generation) == (7, 3, 2)
    text = str(err)
    for part in ("'job'", "'Created'", "'succeed'", "job=7", "seq=3", "gen=2"):
        assert part in text
    assert job.state == JobState.CREATED
    again = pickle.loads(pickle.dumps(err))
    assert (again.machine, again.state, again.trigger, again.job_id) == ("job", "Created",
                                                                         "succeed", 7)


def test_undeclared_trigger_name_is_illegal_too() -> None:
    kv = model(KV_MACHINE)
    with pytest.raises(IllegalTransition, match="'no_such_trigger'"):
        KV_MACHINE.fire(kv, "no_such_trigger")
    assert not KV_MACHINE.may(kv, "no_such_trigger")


@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_terminal_states_are_absorbing_at_run_time(machine: DeclaredMachine) -> None:
    for state in sorted(machine.terminal):
        for trigger in machine.triggers:
            m = SimpleNamespace(state=state, known_good=1, cancel_requested=False)
            assert not machine.may(m, trigger)
            with pytest.raises(IllegalTransition):
                machine.fire(m, trigger)
            assert m.state == state


# ---- extension points ----------------------------------------------------------------

def test_listener_sees_every_change_and_can_be_removed() -> None:
    seen: list[tuple[object, str, str, str]] = []

    def listener(m: object, source: str, dest: str, trigger: str) -> None:
        seen.append((m, source, dest, trigger))

    kv = model(KV_MACHINE)
    KV_MACHINE.add_listener(listener)
    try:
        KV_MACHINE.fire(kv, "mark_submitted")
        KV_MACHINE.fire(kv, "commit")
    finally:
        KV_MACHINE.remove_listener(listener)
    assert seen == [(kv, "Reserved", "Submitted", "mark_submitted"),
                    (kv, "Submitted", "Committed", "commit")]
    KV_MACHINE.fire(model(KV_MACHINE), "rollback")
    assert len(seen) == 2


def test_listener_not_called_when_a_guard_vetoes() -> None:
    seen: list[str] = []

    def listener(m: object, source: str, dest: str, trigger: str) -> None:
        seen.append(trigger)

    job = SimpleNamespace(state=JobState.COMPLETING.value, cancel_requested=True)
    JOB_MACHINE.add_listener(listener)
    try:
        assert JOB_MACHINE.fire(job, "succeed") is False
    finally:
        JOB_MACHINE.remove_listener(listener)
    assert seen == []


def test_on_enter_and_on_exit_callbacks_run_and_are_removable() -> None:
    entered: list[tuple[object, str]] = []
    exited: list[str] = []

    def on_ready(event) -> None:
        entered.append((event.model, event.event.name))

    def on_warming_exit(event) -> None:
        exited.append(event.event.name)

    device = model(LIFECYCLE_MACHINE, known_good=None)
    # State names as plain strings: DeclaredMachine passes them to transitions'
    # get_state, which would look an enum member up by its *name* ("READY").
    LIFECYCLE_MACHINE.on_enter("Ready", on_ready)
    LIFECYCLE_MACHINE.on_exit("Warming", on_warming_exit)
    try:
        for trigger in ("start", "configured", "warmed"):
            LIFECYCLE_MACHINE.fire(device, trigger)
    finally:
        LIFECYCLE_MACHINE.remove_state_callback("Ready", "enter", on_ready)
        LIFECYCLE_MACHINE.remove_state_callback("Warming", "exit", on_warming_exit)
    assert entered == [(device, "warmed")]
    assert exited == ["warmed"]

    other = model(LIFECYCLE_MACHINE, known_good=None)
    for trigger in ("start", "configured", "warmed"):
        LIFECYCLE_MACHINE.fire(other, trigger)
    assert other.state == LifecycleState.READY
    assert len(entered) == 1 and len(exited) == 1


# ---- guards ----------------------------------------------------------------------------

def _completing_job(cancel_requested: bool) -> SimpleNamespace:
    job = model(JOB_MACHINE, cancel_requested=cancel_requested)
    for trigger in ("admit", "prepare", "enqueue", "submit", "complete"):
        JOB_MACHINE.fire(job, trigger)
    return job


@pytest.mark.parametrize("how", ["fire", "fire_if_declared"])
def test_deliverable_vetoes_succeed_for_a_cancelled_job(how: str) -> None:
    fire = getattr(JOB_MACHINE, how)
    job = _completing_job(cancel_requested=True)
    assert fire(job, "succeed") is False
    assert job.state == JobState.COMPLETING
    # The cancelled job still ends, cleanly, in Failed (result dropped).
    assert fire(job, "fail") is True
    assert job.state == JobState.FAILED


def test_deliverable_lets_an_uncancelled_job_succeed() -> None:
    job = _completing_job(cancel_requested=False)
    assert JOB_MACHINE.fire(job, "succeed") is True
    assert job.state == JobState.SUCCEEDED


def test_deliverable_treats_a_model_without_the_flag_as_not_cancelled() -> None:
    job = SimpleNamespace(state=JobState.COMPLETING.value)
    assert JOB_MACHINE.fire(job, "succeed") is True


@pytest.mark.parametrize("source", [LifecycleState.CONFIGURING, LifecycleState.WARMING])
def test_rollback_needs_a_known_good_generation(source: LifecycleState) -> None:
    device = SimpleNamespace(state=source.value, known_good=None)
    assert LIFECYCLE_MACHINE.fire(device, "rollback") is False
    assert device.state == source
    device.known_good = 3
    assert LIFECYCLE_MACHINE.fire(device, "rollback") is True
    assert device.state == LifecycleState.CONFIGURING


def test_rollback_is_illegal_from_ready_even_with_a_known_good() -> None:
    device = SimpleNamespace(state=LifecycleState.READY.value, known_good=3)
    with pytest.raises(IllegalTransition):
        LIFECYCLE_MACHINE.fire(device, "rollback")


# ---- one engine: the direct table equals transitions' Event.trigger ----------------------

def _expected_cases(machine: DeclaredMachine) -> int:
    """states x (triggers + one undeclared name) x 3 outcomes per guard, counted from the
    declaration rows (not from the running machine the checker walks)."""
    guards: dict[tuple[str, str], int] = {}
    for row in machine.declaration:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        k = len(row.get("conditions", ())) + len(row.get("unless", ()))
        for source in sources:
            guards[(source, row["trigger"])] = guards.get((source, row["trigger"]), 0) + k
    return sum(3 ** guards.get((state, trigger), 0)
               for state in machine.states for trigger in (*machine.triggers, "undeclared"))


@pytest.mark.parametrize("machine", ALL_MACHINES, ids=lambda m: m.name)
def test_table_equals_the_engine_for_every_state_trigger_and_guard_outcome(
        machine: DeclaredMachine) -> None:
    report = check_engine_equivalence(machine)
    assert report.mismatches == ()
    assert report.cases == _expected_cases(machine)
    # every declared pair really took the table on the fast side of the comparison
    assert report.direct == report.declared, (
        "a transition left the direct table: re-measure bench/bench_machines.py")


def test_the_machines_declare_62_pairs_all_direct() -> None:
    reports = [check_engine_equivalence(m) for m in ALL_MACHINES[:4]]
    assert [len(r.declared) for r in reports] == [25, 5, 23, 9]   # job, kv, lifecycle, seq
    assert sum(len(r.direct) for r in reports) == 62


def test_the_flow_machine_declares_13_pairs_all_direct() -> None:
    """The fifth machine, a stream's flow: its pairs are all on the direct table too."""
    assert ALL_MACHINES[4] is FLOW_MACHINE
    report = check_engine_equivalence(FLOW_MACHINE)
    assert len(report.declared) == len(report.direct) == 13


@pytest.mark.parametrize(("machine", "variants"), [
    (JOB_MACHINE, [{}, {"cancel_requested": False}, {"cancel_requested": True}]),
    (KV_MACHINE, [{}]),
    (LIFECYCLE_MACHINE, [{}, {"known_good": None}, {"known_good": 3}]),
], ids=lambda v: getattr(v, "name", None) if isinstance(v, DeclaredMachine) else None)
def test_real_guards_see_the_same_event_on_both_paths(
        machine: DeclaredMachine, variants: list[dict]) -> None:
    report = check_engine_equivalence(machine, force_guards=False, variants=variants)
    assert report.mismatches == ()
    assert report.cases == len(machine.states) * (len(machine.triggers) + 1) * len(variants)


def test_checker_restores_the_guards_and_its_listener() -> None:
    cond = JOB_MACHINE.machine.events["succeed"].transitions["Completing"][0].conditions[0]
    check_engine_equivalence(JOB_MACHINE)
    assert cond.func is deliverable
    job = SimpleNamespace(state=JobState.COMPLETING.value, cancel_requested=True)
    assert JOB_MACHINE.fire(job, "succeed") is False  # the real guard again, not a forced one


def _twin(machine: DeclaredMachine) -> DeclaredMachine:
    """A private copy of a shared machine, safe to corrupt."""
    return DeclaredMachine(f"{machine.name}-twin", machine.states, machine.declaration,
                           machine.initial, machine.terminal)


def _cases_of(report) -> set[str]:
    return {line.split(": ")[1] for line in report.mismatches}


def test_checker_passes_an_intact_twin() -> None:
    twin = _twin(JOB_MACHINE)
    assert check_engine_equivalence(twin).mismatches == ()


def test_checker_catches_a_table_entry_with_the_wrong_destination() -> None:
    # The engine now goes Created -admit-> Preparing; the table, not refreshed, still
    # says Admitted: exactly a corrupted table entry.
    twin = _twin(JOB_MACHINE)
    twin.machine.events["admit"].transitions["Created"][0].dest = "Preparing"
    report = check_engine_equivalence(twin)
    assert _cases_of(report) == {"Created --admit--> guards () attrs {}"}
    assert any("fire gave ('returned', True, 'Admitted'" in m for m in report.mismatches)
    twin.refresh()
    assert check_engine_equivalence(twin).mismatches == ()


def test_checker_catches_a_table_entry_missing_a_guard() -> None:
    twin = _twin(JOB_MACHINE)
    twin.machine.events["prepare"].transitions["Admitted"][0].conditions.append(
        Condition(lambda event: True))
    report = check_engine_equivalence(twin)
    # pass (the guard was not consulted), veto (it fired anyway), raise (it did not raise)
    assert _cases_of(report) == {f"Admitted --prepare--> guards ('{o}',) attrs {{}}"
                                 for o in GUARD_OUTCOMES}
    twin.refresh()
    assert check_engine_equivalence(twin).mismatches == ()


def test_checker_catches_a_table_entry_for_an_undeclared_pair() -> None:
    twin = _twin(KV_MACHINE)
    del twin.machine.events["commit"].transitions["Submitted"]
    report = check_engine_equivalence(twin)
    assert _cases_of(report) == {"Submitted --commit--> guards () attrs {}"}
    paths = {line.split(": ")[2].split(" gave ")[0] for line in report.mismatches}
    assert paths == {"fire", "fire_if_declared"}


# ---- fire_via_engine, fire_if_declared, require, is_direct -----------------------------

def test_fire_via_engine_runs_transitions_not_the_table() -> None:
    # A machine-wide hook added behind the declared machine's back: the table does not
    # know it (until refresh), transitions' own Event.trigger runs it.
    twin = _twin(KV_MACHINE)
    hooked: list[str] = []
    twin.machine.before_state_change.append(lambda event: hooked.append(event.event.name))
    assert twin.fire(model(twin), "mark_submitted") is True
    assert hooked == []
    r = model(twin)
    assert twin.fire_via_engine(r, "mark_submitted") is True
    assert (hooked, r.state) == (["mark_submitted"], KvState.SUBMITTED)
    twin.refresh()
    assert not twin.is_direct("Reserved", "mark_submitted")
    assert twin.fire(model(twin), "mark_submitted") is True
    assert hooked == ["mark_submitted"] * 2


def test_fire_via_engine_translates_machine_error() -> None:
    job = model(JOB_MACHINE, job_id=5, seq_id=1, generation=4)
    with pytest.raises(IllegalTransition) as info:
        JOB_MACHINE.fire_via_engine(job, "complete")
    err = info.value
    assert (err.machine, err.state, err.trigger, err.job_id) == ("job", "Created",
                                                                 "complete", 5)
    assert isinstance(err.__cause__, MachineError)
    with pytest.raises(IllegalTransition, match="'nope'"):
        JOB_MACHINE.fire_via_engine(job, "nope")
    assert job.state == JobState.CREATED


def test_a_callbacks_own_machine_error_is_not_relabelled() -> None:
    def jam(event) -> None:
        raise MachineError("jammed inside a callback")

    toy = DeclaredMachine("toy", ["a", "b"], [
        {"trigger": "go", "source": "a", "dest": "b", "after": [jam]}], initial="a",
        terminal=["b"])
    for fire in (toy.fire, toy.fire_via_engine, toy.fire_if_declared):
        with pytest.raises(MachineError, match="jammed"):
            fire(SimpleNamespace(state="a"), "go")


def test_fire_if_declared_fires_only_a_declared_trigger() -> None:
    seen: list[str] = []
    job = model(JOB_MACHINE, cancel_requested=False)

    def listener(m: object, source: str, dest: str, trigger: str) -> None:
        if m is job:
            seen.append(trigger)

    JOB_MACHINE.add_listener(listener)
    try:
        assert JOB_MACHINE.fire_if_declared(job, "admit") is True
        assert job.state == JobState.ADMITTED
        assert JOB_MACHINE.fire_if_declared(job, "succeed") is False  # not from Admitted
        assert JOB_MACHINE.fire_if_declared(job, "no_such_trigger") is False
        assert job.state == JobState.ADMITTED
    finally:
        JOB_MACHINE.remove_listener(listener)
    assert seen == ["admit"]


def test_fire_if_declared_through_the_engine() -> None:
    # With a state callback the pair is not direct: declared goes through transitions,
    # undeclared still answers False without raising.
    entered: list[str] = []

    def on_warming(event) -> None:
        entered.append(event.event.name)

    LIFECYCLE_MACHINE.on_enter("Warming", on_warming)
    try:
        assert not LIFECYCLE_MACHINE.is_direct("Configuring", "configured")
        device = SimpleNamespace(state=LifecycleState.CONFIGURING.value, known_good=None)
        assert LIFECYCLE_MACHINE.fire_if_declared(device, "rollback") is False  # vetoed
        assert LIFECYCLE_MACHINE.fire_if_declared(device, "warmed") is False  # undeclared
        assert LIFECYCLE_MACHINE.fire_if_declared(device, "configured") is True
    finally:
        LIFECYCLE_MACHINE.remove_state_callback("Warming", "enter", on_warming)
    assert (device.state, entered) == (LifecycleState.WARMING, ["configured"])
    assert LIFECYCLE_MACHINE.is_direct("Configuring", "configured")


def test_require_names_an_undeclared_trigger_and_changes_nothing() -> None:
    r = model(KV_MACHINE, job_id=9, seq_id=2)
    KV_MACHINE.require(r, "rollback")
    with pytest.raises(IllegalTransition) as info:
        KV_MACHINE.require(r, "commit")
    assert (info.value.machine, info.value.state, info.value.trigger,
            info.value.job_id) == ("kv", "Reserved", "commit", 9)
    assert r.state == KvState.RESERVED
