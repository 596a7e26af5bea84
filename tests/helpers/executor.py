"""Shared helpers for executor tests: building executors in both modes, and a driver
wrapper that holds ``wait`` on an Event so threaded tests control timing without sleeps."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from calfsm.clock import RealClock
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.plan.capabilities import Evidence, Verdict, device_identity
from calfsm.plan.inflight import REQUIRED_CAPABILITY
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from calfsm.testing.batching import write_batch_evidence

MODES = ("step", "threaded")

TINY = builtin_manifest("tiny")


class GatedDriver:
    """Proxy to a driver whose ``wait`` blocks until the test opens the gate.

    ``submitted`` is set each time ``infer`` succeeds; ``waiting`` when the completion
    thread is inside ``wait``. The recovery thread's waits (its warm-up golden) are not
    held. Everything else passes through unchanged.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.submitted = threading.Event()
        self.waiting = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def infer(self, *a: Any, **kw: Any) -> int:
        rc = self._inner.infer(*a, **kw)
        if rc == 0:
            self.submitted.set()
        return rc

    def infer_fixed(self, *a: Any, **kw: Any) -> int:
        rc = self._inner.infer_fixed(*a, **kw)
        if rc == 0:
            self.submitted.set()
        return rc

    def wait(self, out: Any, timeout_s: float) -> int:
        if threading.current_thread().name == "calfsm-recovery":
            return self._inner.wait(out, timeout_s)   # the warm-up is never held
        self.waiting.set()
        if not self.gate.wait(timeout=30):
            raise AssertionError("test never opened the wait gate")
        return self._inner.wait(out, timeout_s)


def make_sim(mode: str, *, faults: FaultPlan | None = None, manifest=TINY,
             **kw: Any) -> SimDriver:
    """Step mode: the virtual clock (time moves only when driven). Threaded mode: real
    time with zero device latency, so deadlines pass while a test holds the device. The
    whole trace is kept (tests read it through :func:`calls`)."""
    kw.setdefault("trace", True)
    if mode == "threaded":
        kw.setdefault("clock", RealClock())
        kw.setdefault("latency", LatencyModel.zero())
    return SimDriver(manifest, seed=0, faults=faults or FaultPlan.none(), **kw)


def make_executor(mode: str, *, faults: FaultPlan | None = None, manifest=TINY,
                  driver: Any = None, tokenizer: Any = None, **config: Any
                  ) -> DeviceExecutor:
    drv = driver or make_sim(mode, faults=faults, manifest=manifest)
    cfg = ExecutorConfig(threaded=(mode == "threaded"), **config)
    ex = DeviceExecutor(drv, manifest, cfg, tokenizer=tokenizer)
    if isinstance(drv, GatedDriver):      # the warm-up's own jobs do not count
        drv.submitted.clear()
        drv.waiting.clear()
    return ex


@contextmanager
def gated_executor(mode: str, **config: Any) -> Iterator[tuple[DeviceExecutor, GatedDriver]]:
    """An executor on a :class:`GatedDriver` over :func:`make_sim`; the gate is opened
    again on the way out, whatever happened, so ``close()`` never waits on a held job."""
    gated = GatedDriver(make_sim(mode))
    with make_executor(mode, driver=gated, **config) as ex:
        try:
            yield ex, gated
        finally:
            gated.gate.set()


def prefill(seq: int, tokens: Iterable[int] = (1, 2, 3), **kw: Any) -> Request:
    """A prefill request of ``tokens`` on sequence ``seq`` (the job-level tests' unit of
    work); ``kw`` goes to :meth:`Request.prefill`."""
    return Request.prefill(seq, list(tokens), **kw)


def finish(ex: DeviceExecutor, handle: Any, timeout: float = 30.0) -> Any:
    """Drive a step-mode executor until ``handle`` is done; threaded: just wait."""
    if not ex.config.threaded:
        StepScheduler(ex).run_until(handle.done)
    return handle.exception(timeout) if handle.exception(timeout) else handle.result(timeout)


def hold_on_device(ex: DeviceExecutor, gated: GatedDriver, request: Any) -> Any:
    """Close the wait gate, enqueue ``request`` and return its handle once the job is on
    the device (step mode: the scheduler drives it there; threaded: infer returned)."""
    gated.gate.clear()
    handle = ex.enqueue(request)
    if ex.config.threaded:
        assert gated.submitted.wait(5)
    else:
        StepScheduler(ex).run_until(lambda: handle.state == JobState.SUBMITTED)
    return handle


def calls(driver: Any, name: str) -> list[dict]:
    """Trace entries of one driver call (SimDriver JSON-lines trace)."""
    inner = getattr(driver, "_inner", driver)
    out = []
    for line in inner.trace_lines():
        entry = json.loads(line)
        if entry.get("call") == name:
            out.append(entry)
    return out


def always(point: str, effect: str, **kw: Any) -> FaultPlan:
    return FaultPlan.of(FaultRule.always(point, effect, **kw))


def eventually(predicate: Any, timeout: float = 10.0) -> bool:
    """Re-check ``predicate`` until it holds (True) or ``timeout`` seconds passed (False),
    for states no event announces (e.g. a caller blocked inside admission). Use it only
    where a test's verdict does not depend on how fast the state comes."""
    import time

    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            return False
        tick.wait(0.001)
    return True


def renamed(manifest: Any, suffix: str) -> Any:
    """``manifest`` with every sub-model's exact name (and its own name) + ``suffix``: a
    second model for switch and rollback tests."""
    data = manifest.to_dict()
    for sub in data["submodels"]:
        sub["exact_name"] += suffix
    data["name"] = manifest.name + suffix
    return type(manifest).from_dict(data)


class HoldAfterWaits(GatedDriver):
    """A :class:`GatedDriver` that closes its own gate: after ``hold_after(n)``, ``n``
    more waits pass and the next one is held (``held`` is set) until the test opens the
    gate. Threaded mode: a stream's step ``n + 1`` stays on the device, with its first
    ``n`` tokens delivered, while the test cancels, recovers or closes."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.held = threading.Event()
        self._left: int | None = None

    def hold_after(self, n: int) -> None:
        self.held.clear()
        self._left = n

    def wait(self, out: Any, timeout_s: float) -> int:
        if self._left is not None and threading.current_thread().name != "calfsm-recovery":
            if self._left == 0:
                self._left = None
                self.gate.clear()
                self.held.set()
            else:
                self._left -= 1
        return super().wait(out, timeout_s)


def drive(ex: DeviceExecutor, predicate: Any, *, seed: int = 0,
          timeout: float = 30.0) -> None:
    """Until ``predicate()`` holds: step mode runs a seeded scheduler; threaded mode
    re-checks it (:func:`eventually`: a stream's deferred work, such as releasing its
    sequence, rings no bell), failing after ``timeout`` seconds."""
    if ex.config.threaded:
        assert eventually(predicate, timeout), f"not reached within {timeout} s"
    else:
        StepScheduler(ex, seed).run_until(predicate)


def write_evidence(directory: Path, driver: Any, *, holds: bool = True,
                   runtime_version: str | None = None, name: str = "parallel.json") -> Path:
    """An evidence file for ``driver`` as the parallel-mode runner writes it, saying
    two in flight holds (or not); tests/tools/test_runners.py has the runner write the file
    the executor reads."""
    ev = Evidence("parallel_mode", device_identity(driver),
                  runtime_version or driver.version(), "0" * 64, time.time(),
                  {"max_in_flight": 2},
                  {REQUIRED_CAPABILITY: Verdict(holds, "observed" if holds else "refused")})
    path = Path(directory) / name
    path.write_text(ev.to_json(), "utf-8")
    return path


def batching(directory: Path, driver: Any, **evidence: Any) -> dict[str, Any]:
    """ExecutorConfig keywords for continuous batching on ``driver``, its evidence
    written to ``directory``."""
    write_batch_evidence(directory, driver, **evidence)
    return {"evidence_dir": str(directory)}


def two_in_flight(directory: Path, driver: Any) -> dict[str, Any]:
    """ExecutorConfig keywords for two in flight on ``driver``, its evidence written to
    ``directory``."""
    write_evidence(directory, driver)
    return {"max_inflight": 2, "evidence_dir": str(directory)}


class HeldReset:
    """Proxy to a driver whose ``reset`` waits for ``gate`` (``resetting`` is set
    first): a recovery held in progress for as long as the test needs to look at it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.resetting = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def reset(self, kind: Any) -> int:
        self.resetting.set()
        assert self.gate.wait(30), "test never opened the reset gate"
        return self._inner.reset(kind)


def reference_stream(runner: Any, prompt: list[int], params: Any) -> list[int]:
    """What a stream (or a server choice) must give for ``prompt`` on TINY: the direct
    path's float32 logits sampled by a fresh sampler of ``params``, with the stream's
    finish rules (stop tokens, max_tokens, max_seq); logits processors see the prompt
    and the tokens so far. Uses and releases sequence 0."""
    return [tok for tok, _ in reference_seen(runner, prompt, params)]


def reference_seen(runner: Any, prompt: list[int], params: Any) -> list[tuple[int, Any]]:
    """As :func:`reference_stream`, each token with the row its sampler saw: the
    reference model's float32 row after the logits processors (a copy)."""
    contract = TINY.submodel(TaskKind.DECODE)
    sampler = params.sampler_for(contract.vocab, prompt_len=len(prompt))
    row, pos, out = runner.prefill(0, prompt), len(prompt), []
    try:
        while True:
            history = (*prompt, *(t for t, _ in out))
            seen = row.copy()
            for fn in params.logits_processors:
                fn(history, seen)
            tok = sampler.sample(row.copy(), history)
            if sampler.ends(tok, len(out)):
                return out
            out.append((tok, seen))
            if len(out) >= params.max_tokens or pos >= contract.max_seq:
                return out
            row = runner.decode(0, tok, pos)
            pos += 1
    finally:
        runner.release(0)


def log_softmax(row: Any) -> Any:
    """The reference log-probabilities of a row: the whole row at once, in float64."""
    import numpy as np

    z = row.astype(np.float64)
    z -= z.max()
    z -= np.log(np.exp(z).sum())
    return z


def top_logprobs(row: Any, k: int) -> list[tuple[int, float]]:
    """The reference top-k of a row: most likely first, ties by id, none at -inf."""
    import numpy as np

    z = log_softmax(row)
    order = np.lexsort((np.arange(z.shape[0]), -z))
    return [(int(i), float(z[i])) for i in order[:k] if np.isfinite(z[i])]


def outcome(ex: DeviceExecutor, handle: Any, timeout: float = 20.0, *, seed: int = 2) -> Any:
    """The job's error, or None if it succeeded (step mode: drive it there first, on a
    scheduler of ``seed``)."""
    if not ex.config.threaded:
        StepScheduler(ex, seed=seed).run_until(handle.done)
    return handle.exception(timeout)


def settle(ex: DeviceExecutor, predicate: Any = None, timeout: float = 20.0) -> None:
    """Until Ready or Failed, idle, and ``predicate()`` holds."""
    if not ex.config.threaded:
        StepScheduler(ex, seed=1).run_until(
            lambda: ex.lifecycle_state in ("Ready", "Failed") and ex.idle()
            and (predicate is None or predicate()))
        return
    ex.wait_lifecycle("Ready", "Failed", timeout=timeout)
    if predicate is not None:
        assert ex.wait_until(predicate, timeout)


class Call(threading.Thread):
    """Run ``fn(*args, **kw)`` on a thread of its own; ``value`` or ``error`` after."""

    def __init__(self, fn: Any, *args: Any, **kw: Any) -> None:
        super().__init__(name=f"test-{fn.__name__}", daemon=True)
        self._fn, self._args, self._kw = fn, args, kw
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self._fn(*self._args, **self._kw)
        except BaseException as e:      # reported to the test
            self.error = e
