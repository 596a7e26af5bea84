"""Conformance: every fault point fails exactly the call it names, on its nth reaching call,
narrowed by each filter it has; nothing else changes (faults.FAULT_POINTS)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from calfsm.drivers.base import BatchDriver, Driver, EngineSlot, JobTag, OutputStatus, ResetKind
from calfsm.drivers.faults import FAULT_POINTS, UNFAULTED_CALLS, FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel
from calfsm.manifest import TaskKind
from calfsm.testing import refmodel_pure as pure
from calfsm.testing.conformance.util import prepare, setup, small_calbin

V = 64
CB = small_calbin(vocab=V, max_seq=64)
DEC = next(m for m in CB.models if m.kind is TaskKind.DECODE)
TOK, POS = DEC.inputs[0].name, DEC.inputs[1].name
LOGITS = DEC.outputs[0].name
CUR, TOTAL = DEC.csr_names
SEQ = 3
#: a code no honest call returns
INJECTED = 1234
#: with latency, a job is still pending when `wait` comes (so every wait reaches its point)
LATENCY = LatencyModel.fixed(decode_s=0.01)
POINT = {p.name: p for p in FAULT_POINTS}


@attrs.frozen
class Step:
    """One protocol call of the workflow: the point it reaches and what its filters see."""

    call: str
    run: Callable[[], Any]
    where: dict[str, Any] = attrs.field(factory=dict)

    @property
    def point(self) -> str:
        return next(p.name for p in FAULT_POINTS if self.call in p.calls)


@attrs.define
class Workflow:
    """Two decode jobs of one sequence through every call a fault point covers."""

    d: Driver
    h: Any = None
    inp: Any = None
    out: Any = None
    tok: np.ndarray = attrs.field(factory=lambda: np.zeros((1, 1), np.int32))
    pos: np.ndarray = attrs.field(factory=lambda: np.zeros((1, 1), np.int32))
    logits: np.ndarray = attrs.field(factory=lambda: np.zeros((1, 1, V), np.uint16))

    def steps(self) -> list[Step]:
        d = self
        buf = {"seq_id": SEQ}

        def model() -> int:
            rc, d.h = d.d.model(DEC.name)
            return rc

        def create() -> int:
            rc, bufs = d.d.create_buffers(d.h)
            if rc == 0:
                d.inp, d.out = bufs
            return rc

        def job(job_id: int, position: int, submit: Step) -> list[Step]:
            def kv_seq() -> int:        # the host writes the job's token and position first
                d.tok[...] = 5 + position
                d.pos[...] = position
                return d.d.set_kv_seq(d.inp, SEQ)

            def batch_rows() -> int:    # one row (a batch-1 model's only value)
                return d.d.set_batch_rows(d.inp, 1) if _batches(d.d) else 0
            return [
                Step("set_kv_seq", kv_seq, {"seq_id": SEQ}),
                Step("set_batch_rows", batch_rows, buf),
                Step("set_csr", lambda: d.d.set_csr(d.inp, CUR, 1), {**buf, "name": CUR}),
                Step("set_csr", lambda: d.d.set_csr(d.inp, TOTAL, position + 1),
                     {**buf, "name": TOTAL}),
                Step("slice_tensor", lambda: d.d.slice_tensor(d.inp, TOK, 0, 4),
                     {**buf, "name": TOK}),
                Step("undo_slice", lambda: d.d.undo_slice(d.inp, TOK), {**buf, "name": TOK}),
                Step("kv_can_allocate", lambda: d.d.kv_can_allocate(1)),
                Step("kv_apply", lambda: d.d.kv_apply(SEQ, position + 1), {"seq_id": SEQ}),
                submit,
                Step("wait", lambda: d.d.wait(d.out, 1e6), {"seq_id": SEQ, "job_id": job_id}),
                Step("output_bytes", lambda: d.d.output_bytes(d.out, LOGITS)[0],
                     {"seq_id": SEQ, "job_id": job_id, "name": LOGITS}),
            ]

        return [
            Step("configure", lambda: d.d.configure(CB)),
            Step("get_all_models", lambda: d.d.get_all_models()[0]),
            Step("model", model, {"name": DEC.name}),
            Step("create_buffers", create),
            Step("map_buffer", lambda: d.d.map_buffer(d.inp, TOK, d.tok), {"name": TOK}),
            Step("map_buffer", lambda: d.d.map_buffer(d.inp, POS, d.pos), {"name": POS}),
            Step("map_buffer", lambda: d.d.map_buffer(d.out, LOGITS, d.logits),
                 {"name": LOGITS}),
            *job(7, 0, Step("infer", lambda: d.d.infer(d.h, d.inp, d.out, tag=JobTag(7, SEQ)),
                            {"seq_id": SEQ, "job_id": 7})),
            Step("enable_parallel_mode", lambda: d.d.enable_parallel_mode(True)),
            Step("map_buffer", lambda: d.d.map_buffer(d.inp, TOK, d.tok), {**buf, "name": TOK}),
            *job(8, 1, Step("infer_fixed", lambda: d.d.infer_fixed(
                d.h, d.inp, d.out, EngineSlot.PING, tag=JobTag(8, SEQ)),
                {"seq_id": SEQ, "job_id": 8})),
            Step("kv_release", lambda: d.d.kv_release(SEQ, 0), {"seq_id": SEQ}),
            Step("reset", lambda: d.d.reset(ResetKind.CCU)),
            Step("destroy_buffers", lambda: d.d.destroy_buffers(d.inp, d.out), buf),
        ]


def _batches(d: Driver) -> bool:
    """Whether the driver has the batch calls (a driver without them is not asked)."""
    return d.capabilities().batch_rows


def _honest(rc: Any) -> bool:
    return rc is True if isinstance(rc, bool) else rc == 0


def _run(make_driver, rule: FaultRule | None) -> list[str]:
    """Run the workflow with one rule; every call must succeed except the ones the rule
    fails, which must fail exactly as injected and then succeed when repeated. Returns the
    calls that failed, in order."""
    d = make_driver(faults=FaultPlan.of(*(() if rule is None else (rule,))), latency=LATENCY)
    if rule is not None and rule.point == "set_batch_rows" and not _batches(d):
        pytest.skip(f"{d.name} has no batch calls (Capabilities.batch_rows)")
    w = Workflow(d)
    failed = []
    expected = [pure.logits_bf16(h, V) for h in pure.hashes([5, 6])]
    for step in w.steps():
        rc = step.run()
        if not _honest(rc):
            injected = False if POINT[step.point].fail_effect == "refuse" else INJECTED
            assert rc == injected, f"{step.call} returned {rc!r}"
            failed.append(step.call)
            rc = step.run()
            assert _honest(rc), f"{step.call} after its injected failure returned {rc!r}"
        if step.call == "output_bytes":   # nothing the failed calls did changed the job
            assert d.status(w.out) == OutputStatus.DONE_OK
            assert w.logits.reshape(-1).tolist() == expected.pop(0)
    return failed


def _rule(point: str, **kw: Any) -> FaultRule:
    eff = POINT[point].fail_effect
    return FaultRule(point, eff, code=INJECTED if eff == "code" else None, **kw)


_STEPS = Workflow(None).steps()       # the calls only; nothing runs
_REACHING = Counter(s.point for s in _STEPS)


def test_the_workflow_makes_every_call_of_every_point() -> None:
    assert set(_REACHING) == {p.name for p in FAULT_POINTS}
    assert {s.call for s in _STEPS} == {c for p in FAULT_POINTS for c in p.calls}


def test_every_protocol_call_has_a_point_or_returns_no_code() -> None:
    methods = {n for cls in (Driver, BatchDriver) for n, v in vars(cls).items()
               if callable(v) and not n.startswith("_")}
    # row_status returns no code, as status does (docs/driver-protocol.md, Batches)
    unfaulted = set(UNFAULTED_CALLS) | {"row_status"}
    covered = [c for p in FAULT_POINTS for c in p.calls]
    assert len(covered) == len(set(covered))                 # one point per call
    assert set(covered) | unfaulted == methods
    assert not set(covered) & unfaulted


def test_without_a_rule_every_call_succeeds(make_driver) -> None:
    assert _run(make_driver, None) == []


@pytest.mark.parametrize(("point", "nth"), [(p, k) for p, n in _REACHING.items()
                                            for k in range(1, n + 1)])
def test_a_rule_fails_exactly_the_nth_call_of_its_point(make_driver, point, nth) -> None:
    calls = [s.call for s in _STEPS if s.point == point]
    assert _run(make_driver, _rule(point, nth=nth)) == [calls[nth - 1]]


_FILTERED = [(p.name, f) for p in FAULT_POINTS for f in sorted(p.filters)]


@pytest.mark.parametrize(("point", "field"), _FILTERED)
def test_each_filter_narrows_its_point(make_driver, point, field) -> None:
    seen = [s.where.get(field) for s in _STEPS if s.point == point]
    values = [v for v in dict.fromkeys(seen) if v is not None]
    assert values, f"the workflow never gives {point} a {field}"
    for value in values:
        first = seen.index(value)
        call = [s.call for s in _STEPS if s.point == point][first]
        assert _run(make_driver, _rule(point, **{field: value})) == [call]
    other = {"seq_id": SEQ + 1, "job_id": 99, "name": "no_such_name"}[field]
    assert _run(make_driver, _rule(point, **{field: other}, every=1)) == []


def test_rule_fields_at_the_edges_of_their_c_types_reach_the_driver(make_driver) -> None:
    d = make_driver(faults=FaultPlan.of(
        FaultRule("kv_release", "code", code=2**31 - 1),
        FaultRule("kv_release", "code", nth=2, code=-(2**31)),
        FaultRule("infer", "code", job_id=-(2**63), code=77),
        FaultRule("infer", "short_output", nth=2**63 - 1, every=2**63 - 1, count=2**63 - 1,
                  seq_id=2**31 - 1, n_bytes=2**63 - 1),
        FaultRule("infer", "nan", job_id=2**63 - 1, index=2**63 - 1),
        FaultRule("set_csr", "code", name="x" * 255, code=5)))
    # sequences no device can have still reach the point, like any other kv_release
    assert d.kv_release(2**70, 0) == 2**31 - 1
    assert d.kv_release(-(2**70), 0) == -(2**31)
    assert d.kv_release(2**70, 0) == 0
    assert d.configure(CB) == 0
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(-(2**63), 0)) == 77
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(-(2**63), 0)) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(pure.hashes([1])[0], V)
