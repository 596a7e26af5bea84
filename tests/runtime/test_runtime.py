"""The two runtimes on their own (issue 21, item 5): a Pipeline, a DeviceLifecycle and a
:class:`~calfsm.runtime.drive.StepRuntime` or :class:`~calfsm.runtime.drive.ThreadRuntime` wired by
hand, as the executor wires them, with no DeviceExecutor. Step mode is driven by a
seeded :class:`~calfsm.runtime.stepper.StepScheduler` over the runtime's ``Steps``; threaded
mode waits only on job handles and the runtime's own drain and join."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from calfsm.clock import RealClock
from calfsm.drivers import refmodel
from calfsm.drivers.base import Calbin, EngineSlot
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.engine.job import JobHandle, Request
from calfsm.engine.kv import SeqState
from calfsm.engine.lifecycle import DeviceLifecycle, Lifecycle, epoch_builder
from calfsm.engine.pipeline import Pipeline, PipelineTimeouts
from calfsm.engine.recovery import FaultPolicy, RecoveryPolicy
from calfsm.engine.stepcost import ServiceModel
from calfsm.errors import CalfsmError
from calfsm.manifest import TaskKind
from calfsm.runtime.drive import StepRuntime, ThreadRuntime
from calfsm.runtime.stepper import StepScheduler
from calfsm.runtime.sync import THREADS
from tests.helpers.executor import TINY

pytestmark = pytest.mark.timeout(60)

VOCAB = TINY.submodel(TaskKind.DECODE).vocab


class ThreadsSeen:
    """Proxy to a driver recording which thread calls ``infer`` and ``wait``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seen: dict[str, set[str]] = {"infer": set(), "wait": set()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def infer(self, *a: Any, **kw: Any) -> int:
        self.seen["infer"].add(threading.current_thread().name)
        return self._inner.infer(*a, **kw)

    def wait(self, *a: Any, **kw: Any) -> int:
        self.seen["wait"].add(threading.current_thread().name)
        return self._inner.wait(*a, **kw)


class Wired:
    """The executor's parts wired by hand on ``driver``, generation 1 Ready."""

    def __init__(self, runtime: type, driver: Any, **policy: float) -> None:
        self.driver = driver
        self.life = life = Lifecycle(driver.clock, THREADS)
        faults = FaultPolicy(RecoveryPolicy(**policy), sync=THREADS)
        service = ServiceModel(TINY.timing, execution_timeout_s=None)
        self.pipe = Pipeline(
            driver, life, faults, max_inflight=1, engines=(EngineSlot.AUTO,),
            timeouts=PipelineTimeouts(admission_s=10.0, queue_s=10.0,
                                      default_deadline_s=30.0, zombie_wait_s=0.25),
            service=service, apply=lambda v: self.control.apply(v),
            drain=lambda reason: self.control.begin_drain(reason))
        self.control = DeviceLifecycle(
            driver, life, faults, self.pipe, warmup=True, service=service,
            build=epoch_builder(driver, max_inflight=1, slots_per_engine=2,
                                token_budget=None, engines=(EngineSlot.AUTO,), sync=THREADS))
        self.runtime = runtime(self.pipe, self.control, life)
        self.control.start(TINY, Calbin.from_manifest(TINY))
        self.runtime.start()

    def enqueue(self, request: Request) -> JobHandle:
        """What ``enqueue_nowait`` does: accept, then start without blocking."""
        job = self.pipe.admission.accept(request, self.pipe.cancel)
        handle = job.handle
        self.pipe.admission.start(job)
        return handle


def _logits_of(tokens: list[int]) -> np.ndarray:
    want = refmodel.logits_bf16(refmodel.chain(tokens)[-1], VOCAB)
    return (want.astype(np.uint32) << 16).view(np.float32)


def test_the_step_runtime_hooks_into_the_pipeline_and_its_steps_run_every_job():
    w = Wired(StepRuntime, SimDriver(TINY, seed=0))
    assert w.pipe.hooks is w.runtime
    prompts = {0: [1, 2, 3], 1: [9, 8], 2: [4, 4, 4, 4]}
    handles = {s: w.enqueue(Request.prefill(s, p)) for s, p in prompts.items()}
    StepScheduler.for_steps(w.runtime.steps, seed=3).run_until(
        lambda: all(h.done() for h in handles.values()))
    for s, p in prompts.items():
        np.testing.assert_array_equal(handles[s].result(0).logits, _logits_of(p))
    tok = handles[0].result(0).greedy()
    decode = w.enqueue(Request.decode(0, tok, 3))
    w.runtime.wait(decode, None)                # the sync entry drives the steps itself
    np.testing.assert_array_equal(decode.result(0).logits, _logits_of([1, 2, 3, tok]))
    assert w.runtime.steps.idle() and w.pipe.idle()
    assert w.runtime.drain(1.0) == [] and w.runtime.stop(1.0) == []


def test_a_device_fault_is_recovered_by_the_steps_on_a_new_generation():
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=5))
    w = Wired(StepRuntime, SimDriver(TINY, seed=0, faults=plan), grace_period_s=0.01)
    steps = w.runtime.steps
    failed = w.enqueue(Request.prefill(5, [1, 2]))
    StepScheduler.for_steps(steps, seed=1).run_until(failed.done)
    assert isinstance(failed.exception(0), CalfsmError)
    assert w.life.state == "Draining" and w.control.recovery_pending
    StepScheduler.for_steps(steps, seed=1).run_until(
        lambda: w.life.state == "Ready" and steps.idle())
    assert w.life.generation == 2 and w.pipe.counts()[0]["recoveries"] == 1
    kv = w.life.epoch.kv
    assert kv.sequence_state(5) is SeqState.UNKNOWN  # its KV was lost in the reset
    kv.reset_sequence(5)
    again = w.enqueue(Request.prefill(5, [1, 2]))
    StepScheduler.for_steps(steps, seed=2).run_until(again.done)
    np.testing.assert_array_equal(again.result(0).logits, _logits_of([1, 2]))
    assert steps.idle()


def test_the_thread_runtime_calls_infer_only_on_the_submitter_and_wait_only_on_completion():
    driver = ThreadsSeen(SimDriver(TINY, seed=0, clock=RealClock(),
                                   latency=LatencyModel.zero()))
    w = Wired(ThreadRuntime, driver)
    warmup = {k: set(v) for k, v in driver.seen.items()}
    driver.seen = {"infer": set(), "wait": set()}
    prompts = {s: [1 + s, 2, 3] for s in range(6)}      # more than the two slots
    handles = {s: w.enqueue(Request.prefill(s, p)) for s, p in prompts.items()}
    for s, p in prompts.items():
        np.testing.assert_array_equal(handles[s].result(20).logits, _logits_of(p))
    assert driver.seen == {"infer": {"calfsm-submitter"}, "wait": {"calfsm-completion"}}
    me = {threading.current_thread().name}
    assert warmup == {"infer": me, "wait": me}  # the warm-up ran on the starting thread
    assert w.runtime.wait_until(w.pipe.idle, 20)
    w.life.begin_stop()
    w.life.begin_close()
    w.runtime.begin_close(10.0)
    assert w.runtime.drain(10.0) == []
    assert w.runtime.stop(10.0) == []           # every worker thread joined
