"""Conformance: same seed and plan -> the same behaviour and trace; swarm plans per seed."""

from __future__ import annotations

from calfsm.drivers.base import JobTag, OutputStatus, ResetKind
from calfsm.drivers.faults import FaultPlan
from calfsm.manifest import TaskKind
from calfsm.testing.conformance.util import setup, small_calbin

CB = small_calbin(vocab=64, max_seq=128)


def _workload(d) -> list[tuple]:
    """A fixed workload that tolerates any fault; returns what it observed."""
    seen: list[tuple] = []
    if d.configure(CB) != 0:
        seen.append(("configure", "failed"))
        return seen
    dec = setup(d, CB, TaskKind.DECODE)
    for i in range(40):
        seq = i % 3
        pos = i // 3
        ok = d.kv_can_allocate(1)
        applied = d.kv_apply(seq, pos + 1)
        dec.tok[...] = i % 64
        dec.pos[...] = pos
        setup_rcs = (d.set_csr(dec.inp, "cur_seq", 1), d.set_csr(dec.inp, "total_seq", pos + 1),
                     d.set_kv_seq(dec.inp, seq))
        rc = d.infer(dec.model, dec.inp, dec.out, tag=JobTag(i, seq))
        w = d.wait(dec.out, 0.5) if rc == 0 else None
        st = d.status(dec.out)
        seen.append((ok, applied, setup_rcs, rc, w, int(st), dec.logits.reshape(-1)[:4].tolist()))
        if st == OutputStatus.PENDING:
            seen.append(("reset", d.reset(ResetKind.CCU), d.wait(dec.out, 1.0),
                         int(d.status(dec.out))))
    return seen


def test_same_seed_and_plan_same_observations(make_driver) -> None:
    for seed in (1, 2, 3, 5, 8):
        plan = FaultPlan.swarm(seed, rate=0.2)
        a = _workload(make_driver(seed=seed, faults=plan))
        b = _workload(make_driver(seed=seed, faults=plan))
        assert a == b, plan.describe()


def test_different_seeds_different_swarm_plans() -> None:
    plans = [FaultPlan.swarm(s) for s in range(40)]
    assert len(set(plans)) >= 30
    assert FaultPlan.swarm(7) == FaultPlan.swarm(7)
    assert any(not p.rules for p in plans)          # "no faults" is part of the swarm
    assert any(len(p.rules) > 3 for p in plans)
