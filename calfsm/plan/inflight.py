"""How many jobs the executor keeps on the device at once, and why (spec 6.4, 14).

Two in flight (one job on Ping, one on Pong) can hide one job's transfers behind the
other's compute, but only the device can say whether that is safe. So the executor runs
two only when the config asks for it, the driver declares fixed Ping/Pong engine slots
and a parallel mode, AND an evidence file written by the parallel-mode runner
(``examples/vendor/parallel_mode.py``) in the evidence directory (the one rule of
:func:`calfsm.plan.capabilities.evidence_dir`, which ``calfsm capabilities`` and the runners
follow too) proves ``parallel_two_in_flight`` for this device and runtime version.
Anything short of that runs one, with the reason in ``health()`` and once in the log: no
code change either way.
"""

from __future__ import annotations

import os

import attrs

from calfsm.drivers.base import Driver, EngineSlot
from calfsm.plan.capabilities import EvidenceStore, Level, device_identity

__all__ = ["REQUIRED_CAPABILITY", "InflightPlan", "plan_inflight"]

#: the capability two in flight needs proven
REQUIRED_CAPABILITY = "parallel_two_in_flight"
#: the engine slots a device with ping/pong has (spec ``EngineSlot``)
PING_PONG = (EngineSlot.PING, EngineSlot.PONG)


@attrs.frozen
class InflightPlan:
    """What the executor runs: ``max_inflight`` jobs at once, buffers bound to
    ``engines``; ``note`` says why a request was not honoured (None: it was), and
    ``proof`` names the evidence behind two in flight."""

    max_inflight: int
    engines: tuple[EngineSlot, ...]
    note: str | None = None
    proof: str | None = None


ONE = InflightPlan(1, (EngineSlot.AUTO,))


def plan_inflight(requested: int, driver: Driver, *,
                  evidence_dir: str | os.PathLike | None = None) -> InflightPlan:
    """The plan for ``requested`` in-flight jobs on ``driver``, judged on the evidence in
    ``evidence_dir`` (None: the one rule of :func:`calfsm.plan.capabilities.evidence_dir`,
    ``$CALFSM_EVIDENCE_DIR`` else ``./evidence``)."""
    if requested <= 1:
        return ONE

    def one(why: str) -> InflightPlan:
        return attrs.evolve(ONE, note=f"max_inflight={requested} requested, running 1: {why}")

    caps = driver.capabilities()
    if not (caps.parallel_mode and caps.fixed_engine_slots and caps.engine_slots >= 2):
        return one(f"driver {driver.name!r} declares no parallel mode with fixed Ping/Pong "
                   "engine slots")
    answer = EvidenceStore(evidence_dir).capability(
        REQUIRED_CAPABILITY, device=device_identity(driver),
        runtime_version=driver.version(), declared=caps)
    if answer.level is not Level.PROVEN:
        return one(f"{REQUIRED_CAPABILITY} is {answer.level.value}: {answer.reason}")
    note = None
    if requested > len(PING_PONG):
        note = (f"max_inflight={requested} requested, running {len(PING_PONG)}: the device "
                "has two engine slots (Ping and Pong)")
    return InflightPlan(len(PING_PONG), PING_PONG, note=note, proof=answer.reason)
