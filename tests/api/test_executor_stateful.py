"""Model-checking the executor: hypothesis drives a step-mode executor on the simulated
device with a random (swarm) fault plan, random requests, cancels, sequence resets and
forced recoveries, interleaved by a seeded step scheduler, and checks after every step:

- every job reaches exactly one terminal state and yields at most one result, and a
  result only for a job that succeeded (no logits for a failed or cancelled job);
- the KV books balance: reserved = committed + rolled back + unknown + still open;
- leases balance: the pool's leased count equals the jobs of that generation holding one;
- with two in flight (drawn, on evidence), at most one job per engine (Ping, Pong);
- every lifecycle transition taken is a declared one;
- a completion of an older generation changes nothing of the current one (FI14);
- after shutdown no lease is out and no executor thread is alive.
"""

from __future__ import annotations

import tempfile
import threading

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from calfsm.drivers.faults import FaultPlan
from calfsm.engine.job import Request
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import CalfsmError, Unavailable
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.machines.job import JOB_MACHINE
from calfsm.machines.lifecycle import LIFECYCLE_MACHINE
from calfsm.runtime.stepper import StepScheduler
from tests.helpers.executor import TINY, make_sim, two_in_flight

SEQS = 3
#: evidence that two in flight holds on the simulated device, for the examples that
#: draw max_inflight=2 (the same file for every example)
EVIDENCE = tempfile.TemporaryDirectory(prefix="calfsm-evidence-")
DECLARED = {(src, t["dest"], t["trigger"])
            for t in LIFECYCLE_MACHINE.declaration
            for src in (t["source"] if isinstance(t["source"], list) else [t["source"]])}


class ExecutorMachine(RuleBasedStateMachine):
    jobs = Bundle("jobs")

    @initialize(fault_seed=st.integers(0, 10_000), sched_seed=st.integers(0, 10_000),
                inflight=st.sampled_from([1, 2]))
    def start(self, fault_seed: int, sched_seed: int, inflight: int) -> None:
        plan = FaultPlan.swarm(fault_seed, rate=0.15).targeting(range(SEQS), fault_seed)
        self.driver = make_sim("step", faults=plan)
        policy = RecoveryPolicy(grace_period_s=0.05, zombie_wait_s=0.05, error_budget=2)
        two = two_in_flight(EVIDENCE.name, self.driver) if inflight == 2 else {}
        try:
            self.ex = DeviceExecutor(self.driver, TINY, ExecutorConfig(
                threaded=False, execution_timeout_s=0.5, admission_timeout_s=0.3,
                queue_timeout_s=0.3, recovery=policy, **two))
        except CalfsmError as e:
            # a plan that breaks the warm-up ends start-up with a classified error
            assert e.stage is not None
            self.ex = None
            return
        self.sched = StepScheduler(self.ex, seed=sched_seed)
        self.max_inflight = self.ex.health().max_inflight
        assert self.max_inflight == inflight
        self.handles = []
        self.transitions: list[tuple[str, str, str]] = []
        self.ex_life = self.ex.lifecycle.record

        def record(model, src, dst, trigger):
            if model is self.ex_life:
                self.transitions.append((src, dst, trigger))

        self._listener = record
        LIFECYCLE_MACHINE.add_listener(record)
        self._wrap_late_completion()

    def _wrap_late_completion(self) -> None:
        """Instrument the fence: a completion of an older generation must not move the
        current one (wraps the public complete step the scheduler runs)."""
        ex, steps = self.ex, self.sched.steps
        original = steps.complete

        def fenced():
            current = ex.epoch
            before = (current.kv.stats(), current.pool.stats())
            on_device = ex.on_device()
            moved = original()
            gone = [j for j in on_device if j not in ex.on_device()]
            if any(j.epoch is not current for j in gone) and ex.epoch is current:
                assert (current.kv.stats(), current.pool.stats()) == before, \
                    "an old-generation completion changed the current generation"
            return moved

        steps.complete = fenced

    def teardown(self) -> None:
        if getattr(self, "ex", None) is None:
            return
        LIFECYCLE_MACHINE.remove_listener(self._listener)
        try:
            self.ex.close(timeout=5)
        except Unavailable:
            pass                        # a job the device never released: reported, bounded
        for h in self.handles:
            assert h.done(), f"{h} never reached an outcome"
        epoch = self.ex.epoch
        if not self.ex.on_device():
            assert epoch.pool.stats().leased == 0
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("calfsm-") and t.is_alive()]

    def _live(self) -> bool:
        return getattr(self, "ex", None) is not None

    # ---- rules -----------------------------------------------------------------------
    @rule()
    def idle(self) -> None:
        """Always enabled, so an example whose start-up failed is still complete."""

    @precondition(_live)
    @rule(target=jobs, seq=st.integers(0, SEQS - 1), n=st.integers(1, 20),
          decode=st.booleans(), token=st.integers(0, 1023))
    def enqueue(self, seq: int, n: int, decode: bool, token: int):
        ex = self.ex
        try:
            length = ex.epoch.kv.sequence_length(seq)
            if decode and length > 0:
                req = Request.decode(seq, token, length)
            else:
                req = Request.prefill(seq, [(token + i) % 1024 for i in range(n)],
                                      past_len=length)
            h = ex.enqueue(req)
        except Unavailable:
            assert ex.lifecycle_state != "Ready"
            return None
        self.handles.append(h)
        return h

    @precondition(_live)
    @rule(n=st.integers(1, 8), token=st.integers(0, 1023))
    def burst(self, n: int, token: int) -> None:
        """A job on every sequence at once: the queue holds several, so two in flight
        has a second job to put on the other engine."""
        for seq in range(SEQS):
            self.enqueue(seq, n, True, (token + seq) % 1024)

    @precondition(_live)
    @rule(handle=jobs)
    def cancel(self, handle) -> None:
        if handle is not None:
            handle.cancel()

    @precondition(_live)
    @rule(n=st.integers(1, 25))
    def run_steps(self, n: int) -> None:
        for _ in range(n):
            if self.sched.step() is None:
                break
            self.one_job_per_engine()       # after every step, not only every rule

    @precondition(_live)
    @rule(seq=st.integers(0, SEQS - 1))
    def reset_sequence(self, seq: int) -> None:
        if self.ex.lifecycle_state == "Ready":
            try:
                self.ex.reset_sequence(seq)
            except CalfsmError:
                pass                    # open reservation: refused, that is the contract

    @precondition(_live)
    @rule()
    def force_recovery(self) -> None:
        self.ex.recover("model check: forced recovery")

    # ---- invariants --------------------------------------------------------------------
    @invariant()
    def one_outcome_per_job(self) -> None:
        if not self._live():
            return
        for h in self.handles:
            job = h.context
            # resolved exactly when terminal: one outcome, never a second one
            assert h.done() == JOB_MACHINE.is_terminal(job.state), (h, job.state)
            if h.done() and h.exception(0) is None:
                assert job.state == "Succeeded"     # no logits for failed/cancelled jobs

    @invariant()
    def kv_books_balance(self) -> None:
        if not self._live():
            return
        s = self.ex.epoch.kv.stats()
        assert s.reserved == s.committed + s.rolled_back + s.unknown + s.open, s

    @invariant()
    def leases_balance(self) -> None:
        if not self._live():
            return
        epoch = self.ex.epoch
        holding = sum(1 for h in self.handles
                      if h.context.lease is not None and h.context.epoch is epoch)
        stats = epoch.pool.stats()
        assert stats.leased == holding, (stats, holding)
        assert stats.free + stats.leased + stats.quarantined == stats.total

    @invariant()
    def one_job_per_engine(self) -> None:
        if not self._live():
            return
        current = [j for j in self.ex.on_device() if j.epoch is self.ex.epoch]
        assert len(current) <= self.max_inflight, current
        engines = [j.lease.slot.engine for j in current if j.lease is not None]
        assert len(engines) == len(set(engines)), f"two jobs on one engine: {current}"

    @invariant()
    def lifecycle_transitions_are_declared(self) -> None:
        if not self._live():
            return
        for t in self.transitions:
            assert t in DECLARED, t


TestExecutorMachine = ExecutorMachine.TestCase
TestExecutorMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
