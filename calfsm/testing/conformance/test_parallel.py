"""Conformance: parallel mode (``docs/driver-protocol.md``, Parallel mode) — enable, the
in-flight limit, fixed engines, the phased timing and its timeline, drain, close, and
what each reset kind does to it."""

from __future__ import annotations

import math

import pytest

from calfsm.drivers.base import EngineSlot, JobTag, OutputStatus, ResetKind
from calfsm.drivers.sim import LatencyModel
from calfsm.drivers.timeline import Phase, PhaseSpan, busy_s, overlap_s, phase_timeline
from calfsm.errors import CalrtCode as C
from calfsm.manifest import TaskKind
from calfsm.testing import refmodel_pure as pure
from calfsm.testing.conformance.util import (
    Bufs,
    aborted,
    answer,
    pending,
    prepare,
    run,
    setup,
    small_calbin,
)

CB = small_calbin(vocab=64, max_seq=64)
OK = OutputStatus.DONE_OK
SHARE = 0.3
#: every decode job takes 1 s: 0.15 s H2D, 0.7 s compute, 0.15 s D2H
PHASED = LatencyModel.fixed(decode_s=1.0, transfer_share=SHARE)


def _ping_pong(make_driver, latency: LatencyModel = PHASED, **kw):
    d = make_driver(latency=latency, **kw)
    caps = d.capabilities()
    if not (caps.parallel_mode and caps.fixed_engine_slots and caps.engine_slots >= 2):
        pytest.skip("no ping/pong")
    assert d.configure(CB) == 0
    assert d.enable_parallel_mode(True) == 0
    ping = setup(d, CB, TaskKind.DECODE, engine=EngineSlot.PING)
    pong = setup(d, CB, TaskKind.DECODE, engine=EngineSlot.PONG)
    return d, ping, pong


def _submit(d, b: Bufs, engine: EngineSlot, seq: int, token: int, job: int) -> int:
    prepare(d, b, seq, [token], 0)
    return d.infer_fixed(b.model, b.inp, b.out, engine, tag=JobTag(job, seq))


def _logits_ok(b: Bufs, token: int) -> bool:
    return b.logits.reshape(-1).tolist() == pure.logits_bf16(pure.step(pure.H_INIT, token, 0),
                                                            64)


def _spans(d, job_id: int) -> dict[Phase, PhaseSpan]:
    """The phases of the job tagged ``job_id``, or skip on a device without a timeline."""
    spans = phase_timeline(d)
    if spans is None:
        pytest.skip("this device reports no phase timeline")
    return {s.phase: s for s in spans if s.tag is not None and s.tag.job_id == job_id}


# ---- enable, the in-flight limit, engines -----------------------------------------------

def test_two_in_flight_on_ping_and_pong_and_a_third_refused(make_driver) -> None:
    d, ping, pong = _ping_pong(make_driver)
    third = setup(d, CB, TaskKind.DECODE)
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    assert _submit(d, pong, EngineSlot.PONG, 1, 2, 2) == 0
    answer(d, lambda: d.status(pong.out), refused=OutputStatus.PENDING, accepted=OK,
           while_=lambda: pending(d, pong))
    prepare(d, third, 2, [3], 0)
    queued = answer(d, lambda: d.infer(third.model, third.inp, third.out),
                    refused=C.DEVICE_BUSY, accepted=0,
                    while_=lambda: pending(d, ping, pong))                   # two in all
    if queued == C.DEVICE_BUSY:
        queued = answer(d, lambda: d.infer_fixed(third.model, third.inp, third.out,
                                                 EngineSlot.PING),
                        refused=C.DEVICE_BUSY, accepted=0, while_=lambda: pending(d, ping))
    if queued == C.DEVICE_BUSY:
        assert d.status(third.out) == OutputStatus.IDLE                      # not queued
    assert d.wait(ping.out, 1e6) == 0 and d.wait(pong.out, 1e6) == 0
    assert d.status(ping.out) == d.status(pong.out) == OK
    assert _logits_ok(ping, 1) and _logits_ok(pong, 2)
    if queued == C.DEVICE_BUSY:
        assert d.infer(third.model, third.inp, third.out) == 0              # room again
    assert d.wait(third.out, 1e6) == 0 and _logits_ok(third, 3)


def test_two_on_one_engine_are_refused_and_run_one_after_the_other(make_driver) -> None:
    d, ping, _pong = _ping_pong(make_driver)
    other = setup(d, CB, TaskKind.DECODE, engine=EngineSlot.PING)
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    ping_runs = lambda: pending(d, ping)    # noqa: E731
    code = answer(d, lambda: _submit(d, other, EngineSlot.PING, 1, 2, 2),
                  refused=C.DEVICE_BUSY, accepted=0, while_=ping_runs)
    if code == C.DEVICE_BUSY:
        prepare(d, other, 1, [2], 0)
        code = answer(d, lambda: d.infer(other.model, other.inp, other.out),
                      refused=C.DEVICE_BUSY, accepted=0, while_=ping_runs)  # its engine
    if code == C.DEVICE_BUSY:
        assert d.wait(ping.out, 1e6) == 0
        assert _submit(d, other, EngineSlot.PING, 1, 2, 2) == 0
    assert d.wait(ping.out, 1e6) == 0 and d.wait(other.out, 1e6) == 0
    assert _logits_ok(ping, 1) and _logits_ok(other, 2)
    if d.clock.virtual:
        a, b = _spans(d, 1), _spans(d, 2)
        assert overlap_s(a.values(), b.values()) == 0
        assert b[Phase.H2D].start >= a[Phase.D2H].end


def test_infer_fixed_needs_parallel_mode_and_the_right_engine(make_driver) -> None:
    d = make_driver(latency=PHASED)
    caps = d.capabilities()
    if not (caps.parallel_mode and caps.fixed_engine_slots):
        pytest.skip("no ping/pong")
    assert d.configure(CB) == 0
    ping = setup(d, CB, TaskKind.DECODE, engine=EngineSlot.PING)
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == C.UNSUPPORTED    # not enabled
    assert d.enable_parallel_mode(True) == 0
    assert _submit(d, ping, EngineSlot.PONG, 0, 1, 1) == C.INVALID_VALUE  # bound to PING
    assert _submit(d, ping, EngineSlot.AUTO, 0, 1, 1) == C.INVALID_VALUE  # not a fixed one
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    assert d.wait(ping.out, 1e6) == 0 and _logits_ok(ping, 1)


# ---- timing and the timeline ------------------------------------------------------------

def test_ping_and_pong_overlap_transfers_with_compute(make_driver) -> None:
    d, ping, pong = _ping_pong(make_driver)
    if not d.clock.virtual:
        pytest.skip("exact timing needs a virtual clock")
    t0 = d.clock.now()
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    assert _submit(d, pong, EngineSlot.PONG, 1, 2, 2) == 0
    assert d.wait(pong.out, 1e6) == 0
    # B's H2D ran during A's compute: 2 s of work in 2 - SHARE / 2 ... - SHARE / 2 s
    assert d.clock.now() - t0 == pytest.approx(2.0 - SHARE)
    assert d.status(ping.out) == OK and _logits_ok(ping, 1) and _logits_ok(pong, 2)
    a, b = _spans(d, 1), _spans(d, 2)
    assert [s.engine for s in a.values()] == [EngineSlot.PING] * 3
    assert [s.engine for s in b.values()] == [EngineSlot.PONG] * 3
    for spans in (a, b):
        assert [s.duration for s in spans.values()] == pytest.approx([0.15, 0.7, 0.15])
        assert all(s.status is OK for s in spans.values())
    assert overlap_s([b[Phase.H2D]], [a[Phase.COMPUTE]]) == pytest.approx(SHARE / 2)
    # one compute unit, one DMA channel: neither ever runs two things at once
    assert overlap_s([a[Phase.COMPUTE]], [b[Phase.COMPUTE]]) == 0
    dma = [s for s in (*a.values(), *b.values()) if s.phase.on_dma]
    assert busy_s(dma) == pytest.approx(sum(s.duration for s in dma))


def test_serial_mode_never_overlaps(make_driver) -> None:
    d = make_driver(latency=PHASED)
    if not d.clock.virtual:
        pytest.skip("exact timing needs a virtual clock")
    assert d.configure(CB) == 0
    a, b = setup(d, CB, TaskKind.DECODE), setup(d, CB, TaskKind.DECODE)
    t0 = d.clock.now()
    for i, buf in enumerate((a, b)):
        prepare(d, buf, i, [i + 1], 0)
        assert d.infer(buf.model, buf.inp, buf.out, tag=JobTag(i + 1, i)) == 0
        assert d.wait(buf.out, 1e6) == 0
    assert d.clock.now() - t0 == pytest.approx(2.0)        # the share changes no total
    sa, sb = _spans(d, 1), _spans(d, 2)
    assert overlap_s(sa.values(), sb.values()) == 0
    assert busy_s((*sa.values(), *sb.values())) == pytest.approx(2.0)


def test_timeline_shows_pending_jobs_then_how_they_ended(make_driver) -> None:
    d, ping, pong = _ping_pong(make_driver)
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    assert _submit(d, pong, EngineSlot.PONG, 1, 2, 2) == 0
    planned = _spans(d, 2)
    assert {s.status for s in planned.values()} == {OutputStatus.PENDING}
    assert planned[Phase.D2H].end > planned[Phase.COMPUTE].end > planned[Phase.H2D].end
    assert d.wait(pong.out, 1e6) == 0
    ended = _spans(d, 2)
    assert {s.status for s in ended.values()} == {OK}
    assert [(s.start, s.end) for s in ended.values()] == \
        [(s.start, s.end) for s in planned.values()]


def test_a_reset_cuts_the_timeline_of_what_it_aborted(make_driver) -> None:
    d, ping, pong = _ping_pong(make_driver)
    if not d.clock.virtual:
        pytest.skip("needs a virtual clock")
    t0 = d.clock.now()
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    assert _submit(d, pong, EngineSlot.PONG, 1, 2, 2) == 0
    assert d.wait(ping.out, 0.5) == C.TIMEOUT               # A computes, B's H2D is done
    assert d.reset(ResetKind.CCU) == 0
    assert d.status(ping.out) == d.status(pong.out) == OutputStatus.DONE_ABORTED
    a, b = _spans(d, 1), _spans(d, 2)
    assert list(a) == [Phase.H2D, Phase.COMPUTE]             # its D2H never began
    assert a[Phase.COMPUTE].end == pytest.approx(t0 + 0.5)
    assert list(b) == [Phase.H2D]                            # it never reached compute
    assert all(s.status is OutputStatus.DONE_ABORTED for s in (*a.values(), *b.values()))


# ---- drain, close, resets ---------------------------------------------------------------

def test_turning_parallel_mode_off_needs_a_drained_device(make_driver) -> None:
    d, ping, pong = _ping_pong(make_driver)
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    assert _submit(d, pong, EngineSlot.PONG, 1, 2, 2) == 0
    in_flight = lambda: pending(d, ping) or pending(d, pong)     # noqa: E731
    off = answer(d, lambda: d.enable_parallel_mode(False), refused=C.DEVICE_BUSY,
                 accepted=0, while_=in_flight)                # both jobs keep running
    assert d.wait(ping.out, 1e6) == 0
    if off == C.DEVICE_BUSY:
        off = answer(d, lambda: d.enable_parallel_mode(False), refused=C.DEVICE_BUSY,
                     accepted=0, while_=in_flight)            # one is still in flight
    assert d.wait(pong.out, 1e6) == 0
    assert d.status(ping.out) == d.status(pong.out) == OK
    if off == C.DEVICE_BUSY:
        assert d.enable_parallel_mode(False) == 0
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 3) == C.UNSUPPORTED


def test_close_aborts_both_jobs_in_flight(make_driver) -> None:
    d, ping, pong = _ping_pong(make_driver)
    ping.logits[...] = pong.logits[...] = 5
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    assert _submit(d, pong, EngineSlot.PONG, 1, 2, 2) == 0
    answer(d, lambda: d.wait(ping.out, 0.5), refused=C.TIMEOUT, accepted=0,
           while_=lambda: pending(d, ping))     # both have begun (virtual time)
    ended = {1: OutputStatus.DONE_OK, 2: OutputStatus.DONE_OK}
    for job, b, was_aborted in zip((1, 2), (ping, pong), aborted(d, d.close, ping, pong),
                                   strict=True):
        if was_aborted:
            assert (b.logits == 5).all()                                # nothing written
            ended[job] = OutputStatus.DONE_ABORTED
        else:                                   # it had ended before the close: written
            assert _logits_ok(b, job)
    spans = phase_timeline(d)
    if spans is not None:       # the timeline stays readable and says how they ended
        mine = [s for s in spans if s.tag is not None and s.tag.job_id in (1, 2)]
        assert {s.tag.job_id for s in mine} == {1, 2}
        assert all(s.status == ended[s.tag.job_id] for s in mine)
        assert all(math.isfinite(s.end) for s in mine)


@pytest.mark.parametrize("kind", list(ResetKind))
def test_every_reset_kind_turns_parallel_mode_off(make_driver, kind) -> None:
    d, ping, pong = _ping_pong(make_driver)
    if not d.capabilities().can_reset(kind):
        pytest.skip(f"no {kind} reset")
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 1) == 0
    aborted(d, lambda: d.reset(kind), ping)
    if kind is not ResetKind.CCU:           # the configuration is gone: build it again
        assert d.configure(CB) == 0
        ping = setup(d, CB, TaskKind.DECODE, engine=EngineSlot.PING)
        pong = setup(d, CB, TaskKind.DECODE, engine=EngineSlot.PONG)
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 2) == C.UNSUPPORTED   # serial again
    assert d.infer(ping.model, ping.inp, ping.out) == 0
    prepare(d, pong, 1, [2], 0)
    if answer(d, lambda: d.infer(pong.model, pong.inp, pong.out), refused=C.DEVICE_BUSY,
              accepted=0, while_=lambda: pending(d, ping)) == 0:    # one in all
        assert d.wait(pong.out, 1e6) == 0 and d.status(pong.out) == OK
    assert d.wait(ping.out, 1e6) == 0 and d.status(ping.out) == OK
    assert d.enable_parallel_mode(True) == 0                             # the host's job
    assert _submit(d, ping, EngineSlot.PING, 0, 1, 3) == 0
    assert _submit(d, pong, EngineSlot.PONG, 1, 2, 4) == 0
    assert d.wait(ping.out, 1e6) == 0 and d.wait(pong.out, 1e6) == 0
    assert _logits_ok(ping, 1) and _logits_ok(pong, 2)


def test_ping_pong_alternating_sequences_do_not_cross_talk(make_driver) -> None:
    d, ping, pong = _ping_pong(make_driver, latency=LatencyModel.fixed(
        decode_s=0.01, transfer_share=SHARE, jitter=0.5))
    toks = {0: [3 + i % 50 for i in range(40)], 1: [60 - i % 40 for i in range(40)]}
    bufs = {0: (ping, EngineSlot.PING), 1: (pong, EngineSlot.PONG)}
    for pos in range(40):
        for seq in (0, 1):          # both in flight, then both waited for
            b, eng = bufs[seq]
            prepare(d, b, seq, [toks[seq][pos]], pos)
            assert d.infer_fixed(b.model, b.inp, b.out, eng) == 0
        for seq in (0, 1):
            b, _eng = bufs[seq]
            assert d.wait(b.out, 1e6) == 0 and d.status(b.out) == OK
            want = pure.logits_bf16(pure.hashes(toks[seq][:pos + 1])[-1], 64)
            assert b.logits.reshape(-1).tolist() == want, (seq, pos)
    assert run(d, ping, 0, [1], 40) == OK       # AUTO infer on a PING buffer still works
