"""CalrtDriver in real time (the default RealClock): the device thread executes jobs on
its own; ``wait`` blocks without the GIL; resets and close from another thread wake a
waiter; host arrays of a STALE job that outlived a reset stay alive until it finished
(that one on a virtual clock, so that the test, not the scheduler, says when it ends).

The conformance suite runs the emulator on a virtual clock; these are the real-time
behaviours it cannot show. Latencies are a few hundred milliseconds where a test must act
while a job is in flight, so the margins are wide."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from calfsm.clock import VirtualClock
from calfsm.drivers.base import OutputStatus, ResetKind
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel
from calfsm.errors import CalrtCode as C
from calfsm.manifest import TaskKind
from tests.drivers.util import prepare, run, setup, small_calbin
from tests.helpers import refmodel_pure as pure

CB = small_calbin(vocab=64, max_seq=64)
SLOW = LatencyModel.fixed(decode_s=0.3)


@pytest.fixture
def make():
    made: list[CalrtDriver] = []

    def factory(**kw) -> CalrtDriver:
        d = CalrtDriver(**kw)
        made.append(d)
        d.configure(CB)
        return d

    yield factory
    for d in made:
        d.close()


def test_real_clock_by_default(make) -> None:
    d = make()
    assert not d.clock.virtual
    dec = setup(d, CB, TaskKind.DECODE)
    t0 = time.monotonic()
    assert run(d, dec, 0, [1], 0) == OutputStatus.DONE_OK
    assert time.monotonic() - t0 < 1.0
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(pure.hashes([1])[0], 64)


def test_reads_host_memory_when_the_job_runs(make) -> None:
    d = make(latency=SLOW)
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    dec.tok[...] = 2            # 300 ms before the device reads it
    assert d.wait(dec.out, 10.0) == 0
    assert d.status(dec.out) == OutputStatus.DONE_OK
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(pure.step(pure.H_INIT, 2, 0),
                                                               64)


def test_wait_times_out_in_real_time(make) -> None:
    d = make(latency=SLOW)
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    t0 = time.monotonic()
    assert d.wait(dec.out, 0.05) == C.TIMEOUT
    assert time.monotonic() - t0 >= 0.05
    assert d.status(dec.out) == OutputStatus.PENDING
    assert d.wait(dec.out, 10.0) == 0
    assert time.monotonic() - t0 >= 0.25
    assert d.status(dec.out) == OutputStatus.DONE_OK


@pytest.mark.parametrize("how", ["reset", "close"])
def test_reset_or_close_from_another_thread_wakes_the_waiter(make, how) -> None:
    d = make(faults=FaultPlan.of(FaultRule("infer", "hang")))
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    got: list[int] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        got.append(d.wait(dec.out, float("inf")))

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    if how == "reset":
        assert d.reset(ResetKind.CCU) == 0
    else:
        d.close()
    t.join(10.0)
    assert not t.is_alive()
    # woken (0), or refused because close came first (INVALID_STATE): never stuck
    assert got[0] == 0 or (how == "close" and got[0] == C.INVALID_STATE)
    assert d.status(dec.out) == OutputStatus.DONE_ABORTED


def test_threads_submit_and_wait_concurrently(make) -> None:
    d = make(latency=LatencyModel.fixed(decode_s=0.001))
    assert d.enable_parallel_mode(True) == 0
    errors: list[str] = []

    def worker(seq: int) -> None:
        dec = setup(d, CB, TaskKind.DECODE)
        toks = [(seq * 5 + i) % 64 for i in range(20)]
        for pos, tok in enumerate(toks):
            prepare(d, dec, seq, [tok], pos)
            while (rc := d.infer(dec.model, dec.inp, dec.out)) == C.DEVICE_BUSY:
                time.sleep(0)
            if rc or d.wait(dec.out, 10.0) or d.status(dec.out) != OutputStatus.DONE_OK:
                errors.append(f"seq {seq} pos {pos}: rc {rc}")
                return
            if dec.logits.reshape(-1).tolist() != pure.logits_bf16(
                    pure.hashes(toks[:pos + 1])[-1], 64):
                errors.append(f"seq {seq} pos {pos}: logits")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert errors == []


def test_stale_job_keeps_its_host_arrays_alive_after_the_handles_died(make) -> None:
    """The ghost of a reset still writes its output array after every handle to it died,
    so the driver parks the array until the device is done with it. The ghost's end is
    the test's to choose, not a race against ``gc.collect()`` (which takes longer than a
    job's latency in a big test process): the device follows a virtual clock, which
    stands still until the test advances it after the collection; the ghost still
    executes on the device thread, as in real time."""
    d = make(clock=VirtualClock(), latency=SLOW,
             faults=FaultPlan.of(FaultRule("infer", "stale")))
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.reset(ResetKind.CONFIGURATION) == 0
    logits = weakref.ref(dec.logits)
    del dec
    gc.collect()
    assert d.pending_jobs() == 1           # the ghost will still write the output array
    assert logits() is not None            # ... so the driver parked it
    d.clock.advance(SLOW.decode_s / 2)
    assert d.pending_jobs() == 1 and logits() is not None   # not before its time
    d.clock.advance(SLOW.decode_s)         # the ghost's time has come
    assert d.pending_jobs() == 0
    gc.collect()
    assert logits() is None                # released once the device is done with it


@pytest.mark.parametrize("which", ["sim", "calrt"])
def test_ping_pong_overlap_in_real_time(which) -> None:
    """On the wall clock too, the second job's H2D runs during the first one's compute,
    and a wait returns no sooner than the timeline says its job finished."""
    from calfsm.clock import RealClock
    from calfsm.drivers.base import EngineSlot, JobTag
    from calfsm.drivers.sim import SimDriver
    from calfsm.drivers.timeline import Phase, overlap_s

    lat = LatencyModel.fixed(decode_s=0.04, transfer_share=0.5)   # 10 + 20 + 10 ms
    d = SimDriver(clock=RealClock(), latency=lat) if which == "sim" else \
        CalrtDriver(latency=lat)
    try:
        d.configure(CB)
        assert d.enable_parallel_mode(True) == 0
        bufs = [setup(d, CB, TaskKind.DECODE, engine=e) for e in (EngineSlot.PING,
                                                                  EngineSlot.PONG)]
        for i, b in enumerate(bufs):
            prepare(d, b, i, [i + 1], 0)
        t0 = d.clock.now()
        for i, b in enumerate(bufs):
            assert d.infer_fixed(b.model, b.inp, b.out, EngineSlot(i), tag=JobTag(i, i)) == 0
        for b in bufs:
            assert d.wait(b.out, 5.0) == 0 and d.status(b.out) == OutputStatus.DONE_OK
        done = d.clock.now()
        spans = {(s.tag.job_id, s.phase): s for s in d.timeline()}
        a_comp, b_h2d = spans[0, Phase.COMPUTE], spans[1, Phase.H2D]
        assert a_comp.start >= t0 and spans[1, Phase.D2H].end <= done
        assert overlap_s([b_h2d], [a_comp]) > 0.005        # 10 ms unless B came late
        # the compute unit passes from A straight to B: B's transfer was hidden
        assert spans[1, Phase.COMPUTE].start == pytest.approx(a_comp.end, abs=1e-6)
        for i, b in enumerate(bufs):
            assert b.logits.reshape(-1).tolist() == pure.logits_bf16(
                pure.step(pure.H_INIT, i + 1, 0), 64)
    finally:
        d.close()
