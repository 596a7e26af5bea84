"""Streams and jobs from asyncio (issue 13, "Must show"): ``async for`` over a stream,
cancelling the task that consumes it, ``await executor.submit`` cancelled before and
after submit, ``async with`` a sequence, the asyncio twins, and an event loop that no
calfsm call blocks for more than 5 ms with 200 concurrent streams.

Step mode runs on one thread: the test's coroutine pumps a seeded
:class:`~calfsm.runtime.stepper.StepScheduler` one step per loop iteration (:func:`pump`), so
each interleaving of the consumers and the executor replays exactly. Threaded mode holds
a chosen step on the device (:class:`HoldAfterWaits`, :class:`GatedDriver`) instead of
sleeping.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest

from calfsm.clock import RealClock
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import FinishReason, Stream
from calfsm.machines.sequence import SequenceState
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from calfsm.tools.direct import golden_prompts
from tests.helpers.executor import (
    TINY,
    GatedDriver,
    HoldAfterWaits,
    calls,
    drive,
    make_executor,
    make_sim,
)
from tests.helpers.streams import (
    GREEDY,
    PROMPT,
    PROMPTS,
    assert_freed,
    assert_id_reused,
    direct_runner,
    golden_tokens,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def golden() -> list[list[int]]:
    return golden_tokens(PROMPTS[:12], 16)


async def pump(ex: DeviceExecutor, done: Callable[[], bool], seed: int = 0) -> None:
    """Step mode: one scheduler step per loop iteration until ``done()``; the consumers
    run in between. Fails when neither the executor nor the loop can move any more."""
    sched = StepScheduler(ex, seed)
    still = 0
    while not done():
        still = still + 1 if sched.step() is None else 0
        if still > 100:
            raise AssertionError("nothing can move: the executor is idle and the "
                                 "awaited work is not done")
        await asyncio.sleep(0)


async def run(ex: DeviceExecutor, aw: Awaitable[Any], seed: int = 0) -> Any:
    """Await ``aw``, pumping the scheduler meanwhile in step mode."""
    task = asyncio.ensure_future(aw)
    if not ex.config.threaded:
        await pump(ex, task.done, seed)
    return await task


async def consume(stream: Stream) -> list[int]:
    return [ev.token async for ev in stream]


async def settled(ex: DeviceExecutor, stream: Stream) -> None:
    """Until a one-shot stream's sequence was released (threaded: polled off the loop)."""
    if ex.config.threaded:
        await asyncio.to_thread(drive, ex, lambda: stream.sequence.state ==
                                SequenceState.RELEASED)
    else:
        await pump(ex, lambda: stream.sequence.state == SequenceState.RELEASED)


# ---- async for ----------------------------------------------------------------------

def test_async_for_streams_equal_the_reference(mode, golden):
    async def main() -> None:
        with make_executor(mode) as ex:
            streams = [ex.generate(p, GREEDY) for p in PROMPTS[:12]]
            got = await run(ex, asyncio.gather(*map(consume, streams)))
            for i, s in enumerate(streams):
                assert got[i] == golden[i], f"prompt {i}"
                r = await s.final()
                assert r.finish_reason == FinishReason.LENGTH and list(r.tokens) == got[i]
                await settled(ex, s)
            assert_freed(ex)

    asyncio.run(main())


@pytest.mark.parametrize("k", [1, 4])
def test_cancelling_the_async_for_task_cancels_the_stream(mode, golden, k):
    """The task iterating a stream is cancelled after ``k`` events (threaded: step
    ``k + 1`` held on the device): the stream ends ``cancelled`` with those ``k``
    tokens, nothing reaches the consumer afterwards, and everything is freed."""
    gated = HoldAfterWaits(make_sim(mode))

    async def main() -> None:
        with make_executor(mode, driver=gated) as ex:
            if mode == "threaded":
                gated.hold_after(k)
            s = ex.generate(PROMPT, GREEDY)
            got: list[int] = []
            reached = asyncio.Event()

            async def consumer() -> None:
                async for ev in s:
                    got.append(ev.token)
                    if len(got) == k:
                        reached.set()

            task = asyncio.create_task(consumer())
            if mode == "threaded":
                assert await asyncio.to_thread(gated.held.wait, 5)
                await asyncio.wait_for(reached.wait(), 5)
            else:
                await pump(ex, reached.is_set)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gated.gate.set()
            r = await run(ex, s.final())
            assert r.finish_reason == FinishReason.CANCELLED
            assert got == list(r.tokens) == golden[5][:k]
            assert [ev async for ev in s] == []
            await settled(ex, s)
            assert_freed(ex)
            assert ex.stats().cancelled == 1
            assert_id_reused(ex, s.sequence.seq_id)

    try:
        asyncio.run(main())
    finally:
        gated.gate.set()


class _InferLog(GatedDriver):
    """A gated driver that writes each successful ``infer`` into ``log``."""

    def __init__(self, inner: Any, log: list[str]) -> None:
        super().__init__(inner)
        self.log = log

    def infer(self, *a: Any, **kw: Any) -> int:
        rc = super().infer(*a, **kw)
        if rc == 0:
            self.log.append("infer")
        return rc


def test_the_first_token_wakes_its_consumer_before_the_next_step_is_submitted():
    """TTFT as clients see it (issue 38): the first token's consumer is woken before
    the step that carries the token goes to the submitter (on a loaded server that
    submit put 0.9 ms median between the token and its wake). Every later token's step
    goes first: the device's time before the consumer's. Before the change the order
    was a race, the infer first in 2 runs of 3."""
    log: list[str] = []
    gated = _InferLog(make_sim("threaded"), log)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        post = loop.call_soon_threadsafe

        def woken(*a: Any, **kw: Any) -> Any:   # how a stream wakes an asyncio consumer
            log.append("wake")
            return post(*a, **kw)

        with make_executor("threaded", driver=gated) as ex:
            gated.gate.clear()
            gated.waiting.clear()
            stream = ex.generate(PROMPT, attrs.evolve(GREEDY, max_tokens=6))
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.to_thread(gated.waiting.wait, 30)     # the prefill's wait
            await asyncio.sleep(0)
            assert not first.done()                 # parked on the stream: it is woken
            log.clear()
            loop.call_soon_threadsafe = woken       # type: ignore[method-assign]
            gated.gate.set()
            await first
            got = [first.result().token] + [ev.token async for ev in stream]
            loop.call_soon_threadsafe = post        # type: ignore[method-assign]
            assert got == golden_tokens([PROMPT], 6)[0]
            # the first token's wake comes before any infer; what follows it races (the
            # consumer re-parks while the prefill's callbacks wake it again, the
            # submitter thread infers), so only the first entry is the claim
            assert log[0] == "wake" and "infer" in log, log

    try:
        asyncio.run(main())
    finally:
        gated.gate.set()


# ---- await executor.submit ----------------------------------------------------------

def _infers(ex: DeviceExecutor, seq_id: int) -> int:
    return sum(1 for c in calls(ex.driver, "infer") if c["tag"][1] == seq_id)


def test_cancel_await_submit_before_submit_nothing_reaches_the_device(mode):
    """FI11 from asyncio: the job waits behind one held on the device; cancelling the
    awaiting task cancels it, and no infer of it is ever made."""
    gated = GatedDriver(make_sim(mode))

    async def main() -> None:
        with make_executor(mode, driver=gated) as ex:
            gated.gate.clear()
            blocker = ex.enqueue_nowait(Request.prefill(200, [1, 2, 3]))
            drive(ex, lambda: bool(ex.on_device()))
            task = asyncio.create_task(ex.submit(Request.prefill(1, [4, 5, 6])))
            await asyncio.sleep(0)                      # it is accepted and queued
            assert ex.stats().queued == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gated.gate.set()
            drive(ex, lambda: blocker.done() and ex.idle())
            assert _infers(ex, 1) == 0 and _infers(ex, 200) == 1
            ex.reset_sequence(200)
            assert_freed(ex)
            assert ex.stats().cancelled == 1 and ex.epoch.kv.sequence_length(1) == 0

    try:
        asyncio.run(main())
    finally:
        gated.gate.set()


def test_cancel_await_submit_after_submit_drops_the_result(mode):
    """FI12 from asyncio: the job is on the device when its task is cancelled; the
    device finishes it (its wait is made, its KV committed), the result is dropped and
    every resource comes back."""
    gated = GatedDriver(make_sim(mode))

    async def main() -> None:
        with make_executor(mode, driver=gated) as ex:
            gated.gate.clear()
            task = asyncio.create_task(ex.submit(Request.prefill(0, [1, 2, 3])))
            await asyncio.sleep(0)
            drive(ex, lambda: bool(ex.on_device()))
            waits = len(calls(ex.driver, "wait"))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gated.gate.set()
            drive(ex, ex.idle)
            assert len(calls(ex.driver, "wait")) == waits + 1
            assert ex.stats().cancelled == 1 and ex.stats().succeeded == 0
            assert ex.epoch.kv.sequence_length(0) == 3      # the device did run it
            ex.reset_sequence(0)
            assert_freed(ex)

    try:
        asyncio.run(main())
    finally:
        gated.gate.set()


def test_await_submit_returns_the_result(mode):
    async def main() -> None:
        with make_executor(mode) as ex:
            r = await run(ex, ex.submit(Request.prefill(0, PROMPT)))
            assert r.token_count == len(PROMPT)
            ex.reset_sequence(0)
            assert_freed(ex)

    asyncio.run(main())


# ---- sequences and the asyncio twins ------------------------------------------------

def test_async_with_open_sequence_releases_it(mode, golden):
    async def main() -> None:
        with make_executor(mode) as ex:
            async with ex.open_sequence() as seq:
                s = seq.generate(PROMPT, SamplingParams(max_tokens=4))
                assert await run(ex, consume(s)) == golden[5][:4]
                await run(ex, s.final())
                if mode == "threaded":
                    await asyncio.to_thread(drive, ex, lambda: seq.state ==
                                            SequenceState.OPEN)
                else:
                    await pump(ex, lambda: seq.state == SequenceState.OPEN)
                assert ex.epoch.kv.sequence_length(seq.seq_id) == len(PROMPT) + 3
            assert seq.state == SequenceState.RELEASED
            assert ex.epoch.kv.sequence_length(seq.seq_id) == 0
            assert_freed(ex)
            assert_id_reused(ex, seq.seq_id)

    asyncio.run(main())


def test_asyncio_twins_of_the_blocking_calls():
    async def main() -> None:
        drv = make_sim("threaded")
        async with await DeviceExecutor.create(drv, TINY) as ex:
            assert ex.lifecycle_state == "Ready"
            assert ex.recover("operator restart")
            assert await ex.await_lifecycle("Ready", timeout=10) == "Ready"
            assert ex.generation == 2
            r = await ex.submit(Request.prefill(0, [1, 2, 3]))
            assert r.token_count == 3
            ex.reset_sequence(0)
        assert ex.lifecycle_state == "Closed"

    asyncio.run(main())


# ---- the event loop is never blocked ------------------------------------------------

N_STREAMS = 200
LOOP_BUDGET_S = 0.005


def _runqueue_waits() -> dict[int, int]:
    """Nanoseconds each of the process's Python threads has spent runnable but waiting
    for a CPU, by native thread id (Linux ``/proc/self/task/<tid>/schedstat``, second
    field; empty where there is none). A worker thread that holds the GIL and waits for
    a CPU holds the loop up too, and that wait is the machine's, not calfsm's. Only
    Python threads can hold the GIL, so only theirs are read: a process that earlier
    tests left with dozens of native threads (Ray's, a thread pool's) would otherwise
    make this read itself the loop's biggest cost, and their waits say nothing about the
    loop."""
    out = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/schedstat", "rb") as f:
                out[t.native_id] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError, TypeError):
            continue
    return out


def _starved_s(before: dict[int, int], after: dict[int, int]) -> float:
    """Seconds of runqueue wait between two :func:`_runqueue_waits` readings, over the
    threads present in both. A thread that ended in between takes its whole lifetime's
    wait with it (in the full suite, threads that earlier tests left behind end at any
    moment), and one that began brought all of its own: summing the totals would count
    either as a negative or positive wait of this stretch."""
    return sum(max(0, after[t] - w) for t, w in before.items() if t in after) * 1e-9


# C calls that can wait for something other than the GIL: another thread's lock, a
# timer, a file or socket. Time spent inside one on the loop is the loop blocked.
_BLOCKING_CALLS = frozenset({
    "acquire", "sleep", "select", "poll", "epoll", "read", "readinto", "recv",
    "recv_into", "recvfrom", "accept", "connect", "waitpid", "wait", "join", "flock",
    "lockf"})


class BlockingCalls:
    """Wall time the calling thread spends inside blocking C calls while installed (a
    profile hook on this thread only: :func:`sys.setprofile`), with the longest one's
    name. Such a call waits on another thread, a timer or the kernel, so every moment
    in it holds the loop, however loaded the machine is; what the OS and the interpreter
    do between Python instructions (preempting the thread, handing the GIL around) is
    not in it."""

    def __init__(self) -> None:
        self.blocked = 0.0
        self.longest = (0.0, "")
        self._entered: list[tuple[float, str] | None] = []

    def __enter__(self) -> BlockingCalls:
        self._prior = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._prior)

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            name = getattr(arg, "__name__", "")
            if name in _BLOCKING_CALLS:
                # None: a call that cannot wait; its c_return is matched all the same
                self._entered.append((time.perf_counter(), _qualified(arg))
                                     if _can_wait(frame, arg) else None)
        elif (event in ("c_return", "c_exception") and self._entered
              and getattr(arg, "__name__", "") in _BLOCKING_CALLS):
            entered = self._entered.pop()
            if entered is None:
                return
            t0, what = entered
            spent = time.perf_counter() - t0
            self.blocked += spent
            if spent > self.longest[0]:
                self.longest = (spent, what)


def _can_wait(caller: Any, fn: Any) -> bool:
    """Whether the C call ``fn`` made from frame ``caller`` can wait for another thread.
    Two ``acquire`` calls on the loop's path cannot: ``Condition._is_owned``'s (it asks
    ``acquire(False)``, inside every ``notify``) and one of a lock nobody holds (a job's
    fresh latch). Counted in full, such a call's time was the GIL's hand-off around the
    profile hook: while a worker thread that took the GIL meanwhile waits for a CPU that
    another process has, the loop waits too (4.3 ms seen under load), which is the
    machine's time, not calfsm's (the second reading in :class:`Stretches` counts a
    worker's turn with the GIL less its runqueue wait). A lock some thread holds is
    counted in full."""
    if fn.__name__ != "acquire":
        return True
    if caller.f_code is _CONDITION_IS_OWNED:
        return False
    locked = getattr(getattr(fn, "__self__", None), "locked", None)
    return locked is None or locked()


_CONDITION_IS_OWNED = threading.Condition._is_owned.__code__


def _qualified(fn: Any) -> str:
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type(sys)):
        return f"{type(owner).__name__}.{fn.__name__}"
    return f"{getattr(fn, '__module__', None) or '?'}.{fn.__name__}"


class GcPauses:
    """The cyclic collector's pauses while installed (``gc.callbacks``), with the thread
    each ran in. A collection's cost is set by everything young alive in the process,
    not by the call that happened to trigger it, so it is the interpreter's pause, not a
    calfsm call's; the stretches report it apart."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []     # (start, end, thread ident)
        self._started: dict[int, float] = {}

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, _info: dict[str, Any]) -> None:
        me, now = threading.get_ident(), time.perf_counter()
        if phase == "start":
            self._started[me] = now
        elif me in self._started:
            self.pauses.append((self._started.pop(me), now, me))

    def within(self, start: float, end: float, thread: int) -> tuple[float, float]:
        """Seconds of collection between ``start`` and ``end``: in ``thread``, and in
        the other threads."""
        own = other = 0.0
        for a, b, who in self.pauses:
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                if who == thread:
                    own += overlap
                else:
                    other += overlap
        return own, other

    @property
    def total(self) -> float:
        return sum(b - a for a, b, _ in self.pauses)


class Stretches:
    """Each stretch calfsm code ran on the event loop without yielding — a sync call
    (:meth:`call`), or each step of a coroutine between two suspensions (:meth:`wrap`) —
    with how long it held the loop, less the cyclic collector's pauses
    (:class:`GcPauses`), the larger of two readings:

    - its CPU time plus the wall time it spent inside blocking calls made from Python
      (:class:`BlockingCalls`: a sleep, an explicit ``acquire`` or ``wait``, I/O).
      Neither part grows because the machine is busy, so a blocking call is caught
      however loaded the machine is.
    - its wall time less the time the process's Python threads (the loop thread's own
      included) spent waiting for a CPU meanwhile: this catches a wait the profile hook
      cannot see (``with lock:`` enters a C lock without a call event), and counts the
      GIL while another thread holds it, as the loop does pay it. Another process's turn
      on the CPU is the OS's, not a calfsm call's.
    """

    def __init__(self, gc_pauses: GcPauses) -> None:
        self.spans: list[tuple[float, float, float]] = []     # (start, end, held)
        self.longest_blocking = (0.0, "")
        #: the readings of the stretch that held the loop longest (how it came to count)
        self.longest_parts: dict[str, float] = {}
        self.longest_what = ""
        self._gc = gc_pauses

    def _run(self, step: Callable[[], Any], what: str = "") -> Any:
        calls = BlockingCalls()
        q0, c0, t0 = _runqueue_waits(), time.thread_time(), time.perf_counter()
        try:
            with calls:
                return step()
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            own_gc, other_gc = self._gc.within(t0, t1, threading.get_ident())
            wall = max(0.0, t1 - t0 - own_gc)
            cpu = max(0.0, c1 - c0 - own_gc)
            starved = _starved_s(q0, _runqueue_waits())
            held = max(min(wall, cpu + calls.blocked),
                       max(cpu, wall - other_gc - starved))
            self.spans.append((t0, t1, held))
            self.longest_blocking = max(self.longest_blocking, calls.longest)
            if held > self.longest_parts.get("held", -1.0):
                self.longest_what = what
                self.longest_parts = {"held": held, "wall": wall, "cpu": cpu,
                                      "blocked": calls.blocked, "starved": starved,
                                      "other_gc": other_gc}

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._run(lambda: fn(*args), getattr(fn, "__qualname__", ""))

    def wrap(self, coro: Any) -> Awaitable[Any]:
        return _Timed(coro, self)

    @property
    def longest(self) -> float:
        return max(held for _, _, held in self.spans)

    def held_within(self, start: float, end: float) -> float:
        """How long calfsm stretches held the loop between ``start`` and ``end``."""
        total = 0.0
        for a, b, held in self.spans:
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                total += held * overlap / (b - a)
        return total


class _Timed:
    def __init__(self, coro: Any, stretches: Stretches) -> None:
        self._coro, self._stretches = coro, stretches
        self._what = getattr(coro, "__qualname__", type(coro).__name__)

    def __await__(self):
        it = self._coro.__await__()
        step, value = it.send, None
        while True:
            try:
                suspended = self._stretches._run(lambda s=step, v=value: s(v),
                                                 self._what)
            except StopIteration as stop:
                return stop.value
            try:
                value, step = (yield suspended), it.send
            except BaseException as e:          # thrown in: hand it to the coroutine
                value, step = e, it.throw


@attrs.frozen
class LoopRun:
    """One run: the ticker's worst lateness, the part of each tick's lateness calfsm
    stretches account for (worst), the longest stretch, the collector's pauses, and the
    counts. The ticker's figures are the machine's as much as calfsm's (a starved loop
    runs its backlog of many short stretches in one late tick): reported, not judged."""

    worst_tick: float
    worst_held_in_a_tick: float
    longest_stretch: float
    gc_paused: float
    ticks: int
    stretches: int
    longest_blocking: tuple[float, str]
    longest_parts: dict[str, float] = attrs.field(factory=dict)
    longest_what: str = ""

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in self.longest_parts.items())
        return (f"ticker {self.worst_tick * 1e3:.2f} ms late at worst, calfsm held the "
                f"loop {self.worst_held_in_a_tick * 1e3:.2f} ms of a tick, longest "
                f"stretch {self.longest_stretch * 1e3:.2f} ms ({self.stretches} "
                f"stretches, longest blocking call {self.longest_blocking[0] * 1e3:.2f} ms "
                f"in {self.longest_blocking[1] or 'none'}, {self.ticks} ticks, "
                f"{self.gc_paused * 1e3:.1f} ms in the cyclic collector; the longest "
                f"stretch ({self.longest_what}) readings in ms: {parts})")


async def _loop_attempt(prompts: list[list[int]], want: list[list[int]]) -> LoopRun:
    """One run of ``len(prompts)`` streams, measured. Every stream must give the
    reference's tokens."""
    params = SamplingParams(max_tokens=len(want[0]))
    drv = SimDriver(TINY, seed=0, clock=RealClock(), trace=False, wake_lead_s=0,
                    latency=LatencyModel.fixed(decode_s=0.002, prefill_per_token_s=1e-5))
    cfg = ExecutorConfig(max_sequences=256, admission_timeout_s=60, queue_timeout_s=60,
                         default_deadline_s=120)
    ex = await DeviceExecutor.create(drv, TINY, cfg)
    ticks: list[tuple[float, float]] = []              # (due, woke), perf_counter
    gc_pauses = GcPauses()
    spans = Stretches(gc_pauses)
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            due = time.perf_counter() + 0.001
            await asyncio.sleep(0.001)
            ticks.append((due, time.perf_counter()))

    async def one(i: int, go: asyncio.Event) -> Stream:
        await go.wait()
        await asyncio.sleep(i * 0.0003)
        s = spans.call(ex.generate, prompts[i], params)
        tokens = []
        while True:
            try:
                ev = await spans.wrap(s.__anext__())
            except StopAsyncIteration:
                break
            tokens.append(ev.token)
        r = await spans.wrap(s.final())
        assert r.finish_reason == FinishReason.LENGTH, (i, r.error)
        assert tokens == list(r.tokens) == want[i], f"stream {i}"
        return s

    try:
        with gc_pauses:
            go = asyncio.Event()
            tasks = [asyncio.create_task(one(i, go)) for i in range(len(prompts))]
            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.01)
            go.set()
            try:
                streams = await asyncio.wait_for(asyncio.gather(*tasks), 40)
            finally:
                stop.set()
                await tick
        # every one-shot sequence released before closing (see
        # test_close_notices_deferred_work_ending in test_streams.py)
        await asyncio.to_thread(drive, ex, lambda: all(
            s.sequence.state == SequenceState.RELEASED for s in streams))
    finally:
        await ex.aclose()
    # a tick late by less than the budget cannot have been held up by more than it
    late = [(due, woke) for due, woke in ticks if woke - due >= LOOP_BUDGET_S]
    return LoopRun(
        worst_tick=max((woke - due for due, woke in ticks), default=0.0),
        worst_held_in_a_tick=max((spans.held_within(due, woke) for due, woke in late),
                                 default=0.0),
        longest_stretch=spans.longest, gc_paused=gc_pauses.total, ticks=len(ticks),
        stretches=len(spans.spans), longest_blocking=spans.longest_blocking,
        longest_parts=spans.longest_parts, longest_what=spans.longest_what)


GIL_TURN_S = 0.0005


@pytest.fixture
def short_gil_turns():
    """Other threads' turns with the GIL cut to 0.5 ms for the test. A stretch that
    waits for the GIL waits for another thread's turn, whose length the interpreter sets
    (:func:`sys.setswitchinterval`, 5 ms by default: the budget itself), so with the
    default one turn of a busy worker could pass for a calfsm call's block. A blocking
    call is caught whatever the turns are (:class:`BlockingCalls`)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(GIL_TURN_S)
    yield
    sys.setswitchinterval(before)


@pytest.fixture(scope="module")
def loop_workload() -> tuple[list[list[int]], list[list[int]]]:
    """The 200 streams' prompts and the reference's 6 tokens for each."""
    prompts = golden_prompts(N_STREAMS, max_len=64, seed=3)
    runner = direct_runner()
    return prompts, [runner.generate(0, p, 6) for p in prompts]


def _measured(prompts: list[list[int]], want: list[list[int]]) -> LoopRun:
    """One measured run, with the objects made before it frozen out of the cyclic
    collector (a full collection over the whole session's heap is the interpreter's
    pause, and would otherwise land in some stretch)."""
    gc.collect()
    gc.freeze()
    try:
        run = asyncio.run(_loop_attempt(prompts, want))
    finally:
        gc.unfreeze()
    # each stream was measured: generate, one __anext__ per token and the end, final
    assert run.stretches >= len(prompts) * (1 + len(want[0]) + 1 + 1), run.describe()
    return run


@pytest.mark.timeout(120)
def test_200_concurrent_streams_never_block_the_event_loop_over_5ms(loop_workload,
                                                                   short_gil_turns):
    """200 asyncio streams on a threaded executor over a real-time device (2 ms a
    decode). Every stretch of calfsm code on the loop (``generate``, each step of
    ``__anext__`` and ``final``) is timed (:class:`Stretches`); none may reach 5 ms. A
    ticker that sleeps 1 ms at a time records how late it wakes, and the message reports
    it, with the stretches that ran inside each late tick.

    What is measured is calfsm's hold on the loop, not the machine's: its CPU time and
    its blocking calls count in full, another process's turn on a CPU and the cyclic
    collector's pauses do not, and other threads' turns with the GIL are cut to 0.5 ms
    (:func:`short_gil_turns`). The ticker's figures are reported, not judged: a starved
    loop runs its backlog of many short stretches in one late tick, which says nothing
    about any one call. (Quiet, the longest stretch measured 1.15-1.22 ms, most of it
    the profile hook's cost; with both cores taken by busy loops 1.09-1.22 ms in six
    runs while single stretches' wall times reached 6.2 ms.) One run must meet the
    bound; tokens are checked for every stream.
    :func:`test_a_6ms_block_in_generate_fails_the_loop_bound` shows the measure catches
    a blocking call."""
    run = _measured(*loop_workload)
    print(run.describe())
    assert run.longest_stretch < LOOP_BUDGET_S, \
        "a calfsm call held the event loop 5 ms or more: " + run.describe()


@pytest.mark.timeout(120)
def test_a_6ms_block_in_generate_fails_the_loop_bound(loop_workload, short_gil_turns,
                                                     monkeypatch):
    """The measure is not blind: ``generate`` made to block for 6 ms (a sleep, as a
    blocking wait would) is caught over the budget, on a loaded machine too: the time
    inside the sleep is counted whatever else the machine does. 20 streams are
    enough."""
    real = DeviceExecutor.generate

    def blocking_generate(self: DeviceExecutor, *args: Any, **kw: Any) -> Stream:
        time.sleep(0.006)
        return real(self, *args, **kw)

    monkeypatch.setattr(DeviceExecutor, "generate", blocking_generate)
    prompts, want = loop_workload
    run = _measured(prompts[:20], want[:20])
    assert run.longest_stretch >= LOOP_BUDGET_S, run.describe()
