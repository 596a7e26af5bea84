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

from calfsm.errors import IllegalTransition
from calfsm.machines import (
    ALL_MACHINES,
    JOB_MACHINE,
    KV_MACHINE,
    LIFECYCLE_MACHINE,
    DeclaredMachine,
    JobState,
    KvState,
    LifecycleState,
)
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


def test_deliverable_vetoes_succeed_for_a_cancelled_job() -> None:
    job = _completing_job(cancel_requested=True)
    assert JOB_MACHINE.fire(job, "succeed") is False
    assert job.state == JobState.COMPLETING
    # The cancelled job still ends, cleanly, in Failed (result dropped).
    assert JOB_MACHINE.fire(job, "fail") is True
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
