"""How many rows (sequences) the executor puts into one device job, and why (spec 14;
``docs/driver-protocol.md``, Batches).

A calbin whose graphs have a batch dimension ``B > 1`` can carry up to ``B`` sequences
per job, but only the device can say whether its rows really keep apart, whether rows of
different lengths and positions can share a job, and whether a failed job (or row) ever
leaves a row's KV half-written. So the executor batches only when the manifest's decode
graph is a batch graph (``SubmodelContract.batched``), the driver has the batch calls
(``Capabilities.batch_rows``), AND an evidence file written by the batch runner
(``examples/vendor/batch_semantics.py``) in the evidence directory (the one rule of
:func:`calfsm.plan.capabilities.evidence_dir`) proves all of :data:`REQUIRED_CAPABILITIES`
for this device and runtime version. It then runs at most the rows that evidence saw
work (its observation :data:`MAX_ROWS_OBSERVATION`), the graph's ``B``, and what the
configuration asks for. Anything short of that runs one row per job, with the reason in
:attr:`BatchPlan.note`: no code change either way (as :mod:`calfsm.plan.inflight` does for
two jobs in flight).
"""

from __future__ import annotations

import os

import attrs

from calfsm.drivers.base import Driver
from calfsm.errors import InvalidArgument
from calfsm.manifest import Manifest, TaskKind
from calfsm.plan.capabilities import Capability, EvidenceStore, device_identity, format_age

__all__ = ["MAX_ROWS_OBSERVATION", "REQUIRED_CAPABILITIES", "BatchPlan", "observed_max_rows",
           "plan_batching"]

#: the capabilities batching needs proven (all answered by the batch runner)
REQUIRED_CAPABILITIES = ("batch_rows_independent", "batch_mixed_rows",
                         "batch_kv_no_partial_update")
#: the batch runner's observation of the real maximum rows of one job
MAX_ROWS_OBSERVATION = "max_rows"
#: the batch calls a driver must have besides ``set_kv_seq``/``set_csr`` with ``row=``
_BATCH_CALLS = ("set_batch_rows", "row_status")


@attrs.frozen
class BatchPlan:
    """What the executor runs: at most ``max_rows`` rows per job (1: no batching).

    ``note`` says why batching is off although the manifest has batch graphs, or why fewer
    rows than requested run (None: nothing to say — a batch-1 manifest, or every
    requirement proven and the request honoured); ``proof`` names the evidence behind
    ``max_rows > 1``."""

    max_rows: int
    note: str | None = None
    proof: str | None = None


ONE = BatchPlan(1)


def observed_max_rows(answer: Capability) -> int | None:
    """The real maximum rows the evidence behind ``answer`` observed (its observation
    :data:`MAX_ROWS_OBSERVATION`), or None when it has none (or not a count)."""
    ev = answer.evidence
    value = ev.observations.get(MAX_ROWS_OBSERVATION) if ev is not None else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def plan_batching(manifest: Manifest, driver: Driver, *, requested: int | None,
                  evidence_dir: str | os.PathLike | None = None) -> BatchPlan:
    """The plan for ``manifest`` on ``driver``: ``requested`` rows per job at most (None:
    as many as the graph has), judged on the evidence in ``evidence_dir`` (None: the one
    rule of :func:`calfsm.plan.capabilities.evidence_dir`, ``$CALFSM_EVIDENCE_DIR`` else
    ``./evidence``)."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)
                                  or requested < 1):
        raise InvalidArgument(f"requested batch rows must be an integer >= 1 or None, got "
                              f"{requested!r}", stage="config")
    decode = manifest.submodel(TaskKind.DECODE)
    if not decode.batched:
        return ONE
    batch = decode.max_batch
    if requested == 1:
        return ONE                      # asked for one row per job: nothing to prove
    asked = f"{requested} rows requested, " if requested is not None else ""

    def one(why: str) -> BatchPlan:
        return attrs.evolve(ONE, note=f"batch graphs (max_batch {batch}): {asked}running "
                                      f"1 row per job: {why}")

    caps = driver.capabilities()
    if not caps.batch_rows:
        return one(f"driver {driver.name!r} declares no batch calls "
                   "(Capabilities.batch_rows)")
    absent = [c for c in _BATCH_CALLS if not callable(getattr(driver, c, None))]
    if absent:
        return one(f"driver {driver.name!r} declares batch_rows but has no "
                   f"{', '.join(absent)}")
    store = EvidenceStore(evidence_dir)
    device, version = device_identity(driver), driver.version()
    answers = [store.capability(name, device=device, runtime_version=version, declared=caps)
               for name in REQUIRED_CAPABILITIES]
    missing = [a for a in answers if not a.proven]
    if missing:
        said: dict[tuple[str, str], list[str]] = {}     # one reason said once
        for a in missing:
            said.setdefault((a.level.value, a.reason), []).append(a.name)
        return one("; ".join(f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} "
                             f"{level}: {reason}" for (level, reason), names in said.items()))
    seen: dict[str, int | None] = {}
    for a in answers:
        assert a.path is not None
        seen.setdefault(a.path.name, observed_max_rows(a))
    lacking = [name for name, rows in seen.items() if rows is None]
    if lacking:
        return one(f"{', '.join(lacking)} proves the batch capabilities but records no "
                   f"'{MAX_ROWS_OBSERVATION}' observation")
    observed = min(r for r in seen.values() if r is not None)
    if observed < 2:
        return one(f"{', '.join(seen)} observed at most {observed} row(s) per job")
    rows = min(batch, observed, requested if requested is not None else batch)
    ages = {a.path.name: a.age_s for a in answers if a.path is not None}
    proof = (f"{', '.join(f'{n} ({format_age(ages[n])})' for n in seen)} proves "
             f"{', '.join(REQUIRED_CAPABILITIES)} for {device} runtime {version}, "
             f"{MAX_ROWS_OBSERVATION} {observed} observed")
    note = None
    if requested is not None and requested > rows:
        limit = (f"the decode graph has {batch} rows" if rows == batch else
                 f"the evidence saw at most {observed} rows per job work")
        note = f"{requested} rows requested, running {rows}: {limit}"
    return BatchPlan(rows, note=note, proof=proof)
