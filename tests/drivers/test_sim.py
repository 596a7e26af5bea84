"""SimDriver-specific behaviour: trace, real-time mode, threads, jitter, construction."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calfsm.clock import RealClock, VirtualClock
from calfsm.drivers.base import Calbin, OutputStatus, ResetKind
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.errors import CalrtCode as C
from calfsm.errors import InvalidArgument
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.testing.conformance.test_determinism import _workload
from calfsm.testing.conformance.util import prepare, run, setup, small_calbin

CB = small_calbin(vocab=64, max_seq=128)


def test_trace_replays_byte_for_byte(tmp_path) -> None:
    plan = FaultPlan.swarm(3, rate=0.2)
    traces = []
    for _ in range(2):
        d = SimDriver(seed=3, faults=plan, trace_path=tmp_path / f"t{len(traces)}.jsonl")
        _workload(d)
        d.close()
        traces.append((tmp_path / f"t{len(traces)}.jsonl").read_bytes())
    assert traces[0] == traces[1]
    lines = traces[0].decode().splitlines()
    assert json.loads(lines[0])["call"] == "open"
    recs = [json.loads(x) for x in lines]
    assert {"infer", "wait", "exec", "kv_apply", "status"} <= {r["call"] for r in recs}
    assert all(isinstance(r["t"], int) for r in recs)
    assert "0x" not in traces[0].decode()               # no addresses


def test_trace_records_injected_effects() -> None:
    d = SimDriver(faults=FaultPlan.of(FaultRule("infer", "code", code=17)), trace=True)
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 17
    recs = [json.loads(x) for x in d.trace_lines()]
    fault = next(r for r in recs if r["call"] == "fault")
    assert fault == {"t": 0, "call": "fault", "point": "infer", "effect": "code", "rule": 0,
                     "code": 17, "rc": 0}
    assert recs[-1]["call"] == "infer" and recs[-1]["rc"] == 17


def test_trace_off() -> None:
    d = SimDriver(trace=False)
    d.configure(CB)
    assert d.trace_lines() == []


def test_different_seed_with_jitter_changes_timing() -> None:
    lat = LatencyModel.fixed(decode_s=0.01, jitter=0.5)
    ends = []
    for seed in (1, 2, 1):
        d = SimDriver(seed=seed, latency=lat)
        d.configure(CB)
        dec = setup(d, CB, TaskKind.DECODE)
        assert run(d, dec, 0, [1], 0) == OutputStatus.DONE_OK
        ends.append(d.clock.now())
    assert ends[0] == ends[2] != ends[1]
    assert all(0.005 <= t <= 0.015 for t in ends)


def test_construct_from_manifest_or_calbin() -> None:
    m = builtin_manifest("tiny")
    assert SimDriver(m).calbin == Calbin.from_manifest(m)
    assert SimDriver(CB).calbin is CB
    with pytest.raises(InvalidArgument):
        SimDriver("qwen")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        SimDriver(kv_capacity=-1)


def test_shared_virtual_clock_drives_execution() -> None:
    clock = VirtualClock()
    d = SimDriver(clock=clock, latency=LatencyModel.fixed(decode_s=1.0))
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.status(dec.out) == OutputStatus.PENDING
    clock.advance(1.0)                       # whoever drives the test moves time
    assert d.status(dec.out) == OutputStatus.DONE_OK


def test_status_of_foreign_object_raises() -> None:
    d = SimDriver()
    with pytest.raises(InvalidArgument):
        d.status(object())


def test_real_time_wait_sleeps_and_reset_wakes_it() -> None:
    d = SimDriver(clock=RealClock(), latency=LatencyModel.fixed(decode_s=0.02),
                  faults=FaultPlan.of(FaultRule("infer", "hang", nth=2)))
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    # a normal job: wait really sleeps until it is done
    assert run(d, dec, 0, [1], 0) == OutputStatus.DONE_OK
    # a hung job: a waiter blocked in wait is woken by a reset from another thread
    prepare(d, dec, 0, [2], 1)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    result: list[int] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        result.append(d.wait(dec.out, 60.0))

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    # the waiter may or may not be asleep yet; either way the reset ends the job
    assert d.reset(ResetKind.CCU) == 0
    t.join(10.0)
    assert not t.is_alive()
    assert result == [0]
    assert d.status(dec.out) == OutputStatus.DONE_ABORTED


def test_real_time_timeout() -> None:
    d = SimDriver(clock=RealClock(), faults=FaultPlan.of(FaultRule("infer", "hang")))
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 0.01) == C.TIMEOUT


def test_submitter_and_completion_threads() -> None:
    """infer from one thread, wait from another, parallel mode, no lost jobs."""
    d = SimDriver(latency=LatencyModel.fixed(decode_s=0.001))
    d.configure(CB)
    assert d.enable_parallel_mode(True) == 0
    slots = [setup(d, CB, TaskKind.DECODE) for _ in range(2)]
    free = [threading.Semaphore(1) for _ in slots]
    submitted = [threading.Semaphore(0) for _ in slots]
    n = 200
    done: list[int] = []

    def submitter() -> None:
        for i in range(n):
            k = i % 2
            free[k].acquire()
            b = slots[k]
            prepare(d, b, k, [i % 64], 0)
            while d.infer(b.model, b.inp, b.out) != 0:   # the other slot may hold the queue
                pass
            submitted[k].release()

    def completion() -> None:
        for i in range(n):
            k = i % 2
            submitted[k].acquire()
            assert d.wait(slots[k].out, 10.0) == 0
            assert d.status(slots[k].out) == OutputStatus.DONE_OK
            done.append(int(slots[k].logits.reshape(-1)[0]))
            free[k].release()

    threads = [threading.Thread(target=submitter), threading.Thread(target=completion)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(done) == n


def test_kv_words_survive_growth() -> None:
    d = SimDriver()
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    for p in range(100):                     # allocation grows one position per step
        assert run(d, dec, 9, [p % 64], p) == OutputStatus.DONE_OK
    from calfsm.testing import refmodel_pure as pure
    h = pure.hashes([p % 64 for p in range(100)])[-1]
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(h, 64)
    assert d.kv_allocated(9) == 100


def test_unsupported_model_kind_is_device_exception() -> None:
    import attrs
    emb = attrs.evolve(CB.models[0], name="emb", kind=TaskKind.PREFILL_EMBEDS)
    cb = Calbin((emb,))
    d = SimDriver()
    assert d.configure(cb) == 0
    b = setup(d, cb, TaskKind.PREFILL_EMBEDS)
    assert run(d, b, 0, [1], 0) == OutputStatus.DONE_CCU_EXCEPTION


def test_invalid_calbin_structure() -> None:
    import attrs
    bad = attrs.evolve(CB.models[0], tile_d0=None)
    assert SimDriver().configure(Calbin((bad,))) == C.INVALID_CALBIN
    assert SimDriver().configure("calbin") == C.INVALID_CALBIN  # type: ignore[arg-type]
    assert np.dtype("<u2") == np.uint16


@pytest.mark.parametrize("lead", [0.0, 0.0005, 0.004])
def test_real_time_wait_never_returns_before_the_finish_time(lead: float) -> None:
    """The poll that ends a real-time wait precisely must not end it early: a job's
    output is ready no sooner than its latency after infer, whatever the lead."""
    d = SimDriver(clock=RealClock(), latency=LatencyModel.fixed(decode_s=0.003),
                  wake_lead_s=lead, trace=False)
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    clock = d.clock
    for pos in range(8):
        prepare(d, dec, 0, [pos + 1], pos)
        # t0 before infer: the job is scheduled 3 ms after a time no earlier than t0,
        # however long the thread waits for a core between infer and wait
        t0 = clock.now()
        assert d.infer(dec.model, dec.inp, dec.out) == 0
        assert d.wait(dec.out, 5.0) == 0
        assert clock.now() - t0 >= 0.003
        assert d.status(dec.out) == OutputStatus.DONE_OK


@pytest.mark.parametrize("lead", [-0.001, 0.2, float("nan")])
def test_wake_lead_out_of_range_is_refused(lead: float) -> None:
    with pytest.raises(InvalidArgument, match="wake_lead_s"):
        SimDriver(wake_lead_s=lead)


def test_reset_during_the_final_poll_ends_the_wait() -> None:
    """A reset while wait polls the last stretch (lead longer than the job) aborts it."""
    d = SimDriver(clock=RealClock(), latency=LatencyModel.fixed(decode_s=0.05),
                  wake_lead_s=0.1, faults=FaultPlan.of(FaultRule("infer", "hang")))
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(d.wait(dec.out, 0.05)))
    t.start()
    assert d.reset(ResetKind.CCU) == 0
    t.join(10.0)
    assert not t.is_alive()
    assert result in ([0], [C.TIMEOUT])      # aborted by the reset, or timed out first
    assert d.status(dec.out) == OutputStatus.DONE_ABORTED


# ---- trace and timeline bounds, the transfer share ----------------------------------

def _jobs(d: SimDriver, n: int) -> None:
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    for pos in range(n):
        assert run(d, dec, 0, [pos % 64], pos) == OutputStatus.DONE_OK


def test_trace_is_off_by_default_and_a_ring_keeps_the_last_records() -> None:
    off = SimDriver()
    _jobs(off, 5)
    assert off.trace_lines() == []
    full, ring = SimDriver(trace=True), SimDriver(trace=7)
    _jobs(full, 20)
    _jobs(ring, 20)
    lines = full.trace_lines()
    assert len(lines) > 100 and json.loads(lines[0])["call"] == "open"
    assert ring.trace_lines() == lines[-7:]           # the same records, the last seven
    with pytest.raises(InvalidArgument, match="trace"):
        SimDriver(trace=-1)


def test_trace_path_without_a_ring_writes_everything(tmp_path) -> None:
    d = SimDriver(trace_path=tmp_path / "t.jsonl")
    _jobs(d, 3)
    d.close()
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["call"] == "open" and json.loads(lines[-1])["call"] == "close"


def test_timeline_keeps_the_last_jobs_only() -> None:
    d = SimDriver(timeline_jobs=3, latency=LatencyModel.fixed(decode_s=0.01))
    _jobs(d, 10)
    spans = d.timeline()
    assert sorted({s.job for s in spans}) == [8, 9, 10] and len(spans) == 9
    none = SimDriver(timeline_jobs=0)
    _jobs(none, 3)
    assert none.timeline() == []
    with pytest.raises(InvalidArgument, match="timeline"):
        SimDriver(timeline_jobs=-1)


@pytest.mark.parametrize("share", [-0.1, 1.0, 2, float("nan"), "0.3"])
def test_transfer_share_out_of_range_is_refused(share) -> None:
    with pytest.raises(InvalidArgument, match="transfer_share"):
        LatencyModel.fixed(transfer_share=share)


def test_transfer_share_redivides_a_job_without_changing_it() -> None:
    plain = LatencyModel.fixed(decode_s=0.01, h2d_s_per_byte=1e-6, d2h_s_per_byte=1e-6)
    shared = LatencyModel.fixed(decode_s=0.01, h2d_s_per_byte=1e-6, d2h_s_per_byte=1e-6,
                                transfer_share=0.4)
    a = plain.stages(True, 1, 8, 128)
    b = shared.stages(True, 1, 8, 128)
    assert sum(b) == pytest.approx(sum(a))
    assert b[0] == b[2] == pytest.approx(0.2 * sum(a)) and b[1] == pytest.approx(0.6 * sum(a))


@given(st.lists(st.tuples(st.sampled_from(["ping", "pong", "wait_ping", "wait_pong"]),
                          st.integers(1, 40), st.floats(0, 0.02)), min_size=1, max_size=30),
       st.floats(0, 0.9), st.floats(0, 0.5), st.floats(1e-6, 1e-4))
@settings(max_examples=60)
def test_phased_schedule_keeps_one_dma_channel_one_compute_unit_and_the_order(
        ops, share, jitter, per_byte) -> None:
    """Whatever the mix of prefill lengths, waits and idle gaps on Ping and Pong: no two
    transfers share the DMA channel, no two computes the compute unit, jobs finish in
    submission order, and every output is the reference model's."""
    from calfsm.drivers.base import EngineSlot, JobTag
    from calfsm.drivers.timeline import Phase, busy_s
    from calfsm.testing import refmodel_pure as pure
    from calfsm.testing.conformance.util import last_row

    lat = LatencyModel(h2d_s_per_byte=per_byte, prefill_per_token_s=2e-3, decode_s=0.01,
                       d2h_s_per_byte=per_byte / 4, jitter=jitter, transfer_share=share)
    d = SimDriver(latency=lat, seed=5)
    d.configure(CB)
    assert d.enable_parallel_mode(True) == 0
    bufs = {e: setup(d, CB, TaskKind.PREFILL_IDS, engine=e)
            for e in (EngineSlot.PING, EngineSlot.PONG)}
    pending: dict[EngineSlot, list[int]] = {}

    def finish(engine: EngineSlot) -> None:
        b, toks = bufs[engine], pending.pop(engine)
        assert d.wait(b.out, 1e6) == 0 and d.status(b.out) is OutputStatus.DONE_OK
        assert last_row(b, len(toks)).tolist() == pure.logits_bf16(pure.hashes(toks)[-1], 64)

    for n, (op, length, idle) in enumerate(ops):
        engine = EngineSlot.PING if op.endswith("ping") else EngineSlot.PONG
        if engine in pending:
            finish(engine)
        if op.startswith("wait"):
            continue
        d.clock.advance(idle)
        toks = [(n * 7 + i) % 64 for i in range(length)]
        b = bufs[engine]
        prepare(d, b, n, toks, 0)
        assert d.infer_fixed(b.model, b.inp, b.out, engine, tag=JobTag(n, n)) == 0
        pending[engine] = toks
    for engine in list(pending):
        finish(engine)
    spans = d.timeline()
    dma = [s for s in spans if s.phase.on_dma]
    comp = [s for s in spans if s.phase is Phase.COMPUTE]
    assert busy_s(dma) == pytest.approx(sum(s.duration for s in dma), abs=1e-9)
    assert busy_s(comp) == pytest.approx(sum(s.duration for s in comp), abs=1e-9)
    finishes = [s.end for s in spans if s.phase is Phase.D2H]
    assert finishes == sorted(finishes)
    assert [s.job for s in spans if s.phase is Phase.D2H] == sorted(
        s.job for s in spans if s.phase is Phase.D2H)
