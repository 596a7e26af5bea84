"""The batch runner (examples/vendor/batch_semantics.py) and the executor's reading of its
evidence (calfsm.plan.batching.plan_batching).

- On the simulated device with ``tiny-b8`` it proves all three batch capabilities and
  records ``max_rows`` 8; on the native emulator too, once it has the batch calls.
- Devices that break one promise (small SimDriver doubles below, or a fault plan) fail
  exactly the matching capability, with a reason naming what was seen; a device whose
  8th row is wrong has a real maximum of 7.
- A batch-1 manifest is bad usage and writes nothing; a device too fast to time out
  leaves the evidence incomplete.
- ``plan_batching``: 8 rows on that evidence, fewer when asked, 1 with a note naming the
  reason when the evidence is missing, stale, failing, incomplete or says no max rows,
  or the driver lacks the batch calls, and no note at all on a batch-1 manifest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from calfsm.drivers import refmodel
from calfsm.drivers.base import Capabilities, OutputStatus, ResetKind
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.errors import InvalidArgument
from calfsm.manifest import builtin_manifest
from calfsm.plan.batching import BatchPlan, plan_batching
from calfsm.plan.capabilities import Evidence, EvidenceStore, Level
from tests.helpers.vendor import runner

B8 = builtin_manifest("tiny-b8")
TINY = builtin_manifest("tiny")
CAPS = ("batch_rows_independent", "batch_mixed_rows", "batch_kv_no_partial_update")
ALL_HOLD = dict.fromkeys(CAPS, True)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def mod() -> ModuleType:
    return runner("batch_semantics")


def run(mod: ModuleType, out: Path, *extra: str, driver: str = "sim",
        given: SimDriver | None = None) -> tuple[int, Evidence, Path]:
    rc = mod.main(["--manifest", "tiny-b8", "--driver", driver, "--out", str(out), *extra],
                  driver=given)
    (path,) = out.glob("batch_semantics-*-0.7.6.json")
    return rc, Evidence.load(path), path


def holds(ev: Evidence) -> dict[str, bool]:
    return {k: v.holds for k, v in ev.verdicts.items()}


@pytest.fixture(scope="module")
def proven(mod: ModuleType, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[int, Evidence, Path]:
    """The runner's evidence from the simulated device (run once for the module)."""
    return run(mod, tmp_path_factory.mktemp("proven"))


# ---------------------------------------------------------------------------------------
# devices that break one promise each (the simulated device's batch job, altered)


def _logits(job) -> np.ndarray:
    return job.out.maps[job.model.out_name].reshape(job.model.batch, -1)


class SwappedPrefillRows(SimDriver):
    """Its batch prefill jobs hand rows 0 and 1 each other's logits (decode is right)."""

    def _execute_rows(self, job) -> None:
        super()._execute_rows(job)
        if not job.model.decode and job.rows >= 2:
            dest = _logits(job)
            dest[[0, 1]] = dest[[1, 0]]


class EighthRowBroken(SimDriver):
    """A decode job of all 8 rows gets row 7's logits wrong: 7 rows really work."""

    def _execute_rows(self, job) -> None:
        super()._execute_rows(job)
        if job.model.decode and job.rows == 8:
            _logits(job)[7] ^= 1


class DropsLastRowKV(SimDriver):
    """A batch decode job of 2+ rows never writes its last row's KV (its logits right)."""

    def _execute_rows(self, job) -> None:
        seq = job.seqs[-1]
        keep = self._kv[seq].copy() if job.model.decode and job.rows >= 2 else None
        super()._execute_rows(job)
        if keep is not None:
            self._kv[seq][:len(keep)] = keep


class PartialKVOnFailedRow(SimDriver):
    """A row that fails its checks (DONE_CCU_EXCEPTION) still writes its first token's KV
    word: a partial update."""

    def _execute_rows(self, job) -> None:
        super()._execute_rows(job)
        m, inp = job.model, job.inp
        tok = inp.maps[m.tok_name].reshape(-1)
        pos = inp.maps[m.pos_name].reshape(-1)
        for r in range(job.rows):
            if job.out.row_status[r] is OutputStatus.DONE_CCU_EXCEPTION:
                kv, p = self._kv[job.seqs[r]], int(pos[r * m.pos_per_row])
                prev = refmodel.H_INIT if p == 0 else int(kv[p - 1])
                kv[p] = refmodel.step(prev, int(tok[r * m.max_tokens]), p)


class NoBatchCalls(SimDriver):
    """A driver of the protocol before batches: no set_batch_rows, no row_status."""

    set_batch_rows = None
    row_status = None

    def capabilities(self) -> Capabilities:
        return Capabilities(resets=frozenset(ResetKind), parallel_mode=True,
                            fixed_engine_slots=True, engine_slots=2, batch_rows=False)


# ---------------------------------------------------------------------------------------
# the runner


def test_the_sim_proves_every_batch_capability_and_eight_rows(proven, tmp_path: Path
                                                              ) -> None:
    rc, ev, path = proven
    assert rc == 0 and ev.complete and ev.passed
    assert (ev.runner, ev.device, ev.driver) == ("batch_semantics", "sim", "sim")
    assert ev.calbin_sha256 == B8.calbin_sha256
    assert holds(ev) == ALL_HOLD
    obs = ev.observations
    assert obs["max_rows"] == 8 and obs["batch"] == 8
    m = obs["max_rows_probe"]
    assert m["refuses_more_than_batch"] and m["set_batch_rows"]["9"] == "INVALID_VALUE"
    assert m["set_batch_rows"]["0"] == "INVALID_VALUE" and m["accepted"] == 8
    assert [c["rows"] for c in obs["independence"]["counts"]] == [2, 3, 4, 8]
    assert obs["independence"]["problems"] == 0 and obs["mixed"]["problems"] == 0
    # mixed rows: different lengths and starts, a 1-token row, rows past one tile
    pre = obs["mixed"]["prefill"]
    assert len(set(pre["starts"])) > 1 and 1 in pre["lengths"] and max(pre["lengths"]) > 16
    assert len(set(obs["mixed"]["decode"]["positions"])) == 8
    by_name = {f["scenario"]: f for f in obs["failures"]}
    assert set(by_name) == {"row_rejected", "timeout_then_late_completion",
                            "timeout_then_reset_ccu", "timeout_then_reset_configuration"}
    rejected = by_name["row_rejected"]
    assert rejected["status"] == "DONE_OK" and rejected["rejected_row"] == 4
    assert rejected["row_status"][4] == "DONE_CCU_EXCEPTION"
    assert rejected["outcomes"] == ["complete"] * 4 + ["untouched"] + ["complete"] * 3
    assert by_name["timeout_then_reset_ccu"]["outcomes"] == ["untouched"] * 8
    assert (m["duplicate_seq"], m["missing_row_config"]) == ("infer: INVALID_VALUE",
                                                            "infer: MISSING_CONFIG")
    assert m["set_batch_rows_output"] == "WRONG_DIRECTION"
    late = by_name["timeout_then_late_completion"]
    assert late["row_status_pending"] == ["PENDING"] * 8
    assert late["set_batch_rows_pending"] == "DEVICE_BUSY"
    assert obs["protocol_deviations"] == []
    assert "max rows 8 of 8" in ev.verdicts["batch_rows_independent"].reason
    summary = path.with_suffix(".md").read_text()
    assert all(f"`{c}`" in summary for c in CAPS)
    store = EvidenceStore(path.parent)
    for cap in CAPS:
        c = store.capability(cap, device="sim", runtime_version="0.7.6",
                             calbin_sha256=B8.calbin_sha256)
        assert c.level is Level.PROVEN and c.path == path


def test_the_emulator_answers_the_same(mod: ModuleType, tmp_path: Path) -> None:
    from calfsm.drivers.calrt import CalrtDriver
    with CalrtDriver.virtual(manifest_or_calbin=B8) as d:
        if not d.capabilities().batch_rows:
            pytest.skip("the native emulator has no batch calls yet")
    rc, ev, _ = run(mod, tmp_path, driver="calrt")
    assert rc == 0 and ev.complete and ev.device == "calrt:libcalrt_emu.so"
    assert holds(ev) == ALL_HOLD and ev.observations["max_rows"] == 8
    assert ev.observations["protocol_deviations"] == []


def test_a_batch_1_manifest_is_bad_usage_and_writes_nothing(
        mod: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert mod.main(["--manifest", "tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "max_batch 1" in err and "tiny-b8" in err
    assert not list(tmp_path.iterdir())


def test_rows_that_swap_logits_are_not_independent(mod: ModuleType, tmp_path: Path) -> None:
    rc, ev, _ = run(mod, tmp_path, "--steps", "1", given=SwappedPrefillRows(B8))
    assert rc == 0 and ev.complete
    assert ev.observations["max_rows"] == 8            # its decode jobs are right
    assert holds(ev) == {"batch_rows_independent": False, "batch_mixed_rows": False,
                         "batch_kv_no_partial_update": True}
    why = ev.verdicts["batch_rows_independent"].reason
    assert "2 rows, step 0, row 0" in why and "differ from the same row run alone" in why


def test_a_row_whose_kv_is_not_written_is_cross_talk(mod: ModuleType, tmp_path: Path) -> None:
    rc, ev, _ = run(mod, tmp_path, "--steps", "2", given=DropsLastRowKV(B8))
    assert rc == 0 and ev.observations["max_rows"] == 8
    assert holds(ev) == {"batch_rows_independent": False, "batch_mixed_rows": False,
                         "batch_kv_no_partial_update": True}
    assert "step 2" in ev.verdicts["batch_rows_independent"].reason
    assert "KV word at" in ev.verdicts["batch_mixed_rows"].reason


def test_the_real_maximum_is_the_most_rows_that_work(mod: ModuleType, tmp_path: Path) -> None:
    rc, ev, path = run(mod, tmp_path, "--steps", "1", given=EighthRowBroken(B8))
    assert rc == 0 and holds(ev) == ALL_HOLD
    obs = ev.observations
    assert obs["max_rows"] == 7
    assert [t["rows"] for t in obs["max_rows_probe"]["trials"]] == [8, 7]
    assert [c["rows"] for c in obs["independence"]["counts"]] == [2, 3, 4, 7]
    assert "max rows 7 of 8" in ev.verdicts["batch_rows_independent"].reason
    plan = plan_batching(B8, SimDriver(B8), requested=None, evidence_dir=path.parent)
    assert plan == BatchPlan(7, None, plan.proof) and "max_rows 7" in plan.proof


def test_a_failed_row_that_writes_its_kv_partly_is_disproved(mod: ModuleType, tmp_path: Path
                                                            ) -> None:
    rc, ev, path = run(mod, tmp_path, "--steps", "1", given=PartialKVOnFailedRow(B8))
    assert rc == 0 and ev.complete
    assert holds(ev) == {"batch_rows_independent": True, "batch_mixed_rows": True,
                         "batch_kv_no_partial_update": False}
    why = ev.verdicts["batch_kv_no_partial_update"].reason
    assert "row_rejected, row 4 (DONE_CCU_EXCEPTION): F's KV is partial" in why
    plan = plan_batching(B8, SimDriver(B8), requested=None, evidence_dir=path.parent)
    assert plan.max_rows == 1 and plan.proof is None
    assert "batch_kv_no_partial_update is failed: does not hold" in plan.note
    assert "F's KV is partial" in plan.note


def test_fault_plans_disprove_the_capability_they_hit(mod: ModuleType, tmp_path: Path) -> None:
    # NaN in row 1 of the first batch job of the independence phase
    nan = FaultPlan.of(FaultRule("infer", "nan", seq_id=mod.SEQ_INDEPENDENT + 1))
    rc, ev, _ = run(mod, tmp_path / "nan", "--steps", "1", given=SimDriver(B8, faults=nan))
    assert rc == 0 and holds(ev) == {"batch_rows_independent": False,
                                     "batch_mixed_rows": True,
                                     "batch_kv_no_partial_update": True}
    assert f"2 rows, step 0, row 1 (seq {mod.SEQ_INDEPENDENT + 1}, " in \
        ev.verdicts["batch_rows_independent"].reason
    # one row of the mixed prefill fails on the device
    row = FaultPlan.of(FaultRule("infer", "row_ccu_exception", seq_id=mod.SEQ_MIXED))
    rc, ev, _ = run(mod, tmp_path / "row", "--steps", "1", given=SimDriver(B8, faults=row))
    assert rc == 0 and holds(ev) == {"batch_rows_independent": True,
                                     "batch_mixed_rows": False,
                                     "batch_kv_no_partial_update": True}
    assert "mixed prefill, row 0" in ev.verdicts["batch_mixed_rows"].reason
    assert "row status DONE_CCU_EXCEPTION" in ev.verdicts["batch_mixed_rows"].reason


def test_a_driver_without_batch_calls_answers_no(mod: ModuleType, tmp_path: Path) -> None:
    rc, ev, _ = run(mod, tmp_path, given=NoBatchCalls(B8))
    assert rc == 0 and ev.complete and holds(ev) == dict.fromkeys(CAPS, False)
    assert "has no batch calls (set_batch_rows, row_status)" in \
        ev.verdicts["batch_mixed_rows"].reason
    assert ev.observations["max_rows"] == 1


def test_a_device_too_fast_to_time_out_leaves_it_incomplete(mod: ModuleType, tmp_path: Path
                                                           ) -> None:
    rc, ev, path = run(mod, tmp_path, "--steps", "1", "--exec-timeout-s", "10")
    assert rc == 1 and not ev.complete
    assert "batch_kv_no_partial_update" not in ev.verdicts
    errors = [f.get("error") for f in ev.observations["failures"]]
    assert errors[0] is None and "F finished inside the execution deadline" in errors[1]
    plan = plan_batching(B8, SimDriver(B8), requested=None, evidence_dir=path.parent)
    assert plan.max_rows == 1
    assert "batch_rows_independent" in plan.note and "incomplete" in plan.note
    assert "batch_kv_no_partial_update" in plan.note and "claimed" in plan.note


# ---------------------------------------------------------------------------------------
# plan_batching


def test_plan_on_the_evidence_runs_every_row_or_fewer_when_asked(proven) -> None:
    _rc, _ev, path = proven
    d = SimDriver(B8)
    plan = plan_batching(B8, d, requested=None, evidence_dir=path.parent)
    assert plan.max_rows == 8 and plan.note is None
    assert path.name in plan.proof and "max_rows 8 observed" in plan.proof
    assert plan_batching(B8, d, requested=4, evidence_dir=path.parent) == \
        BatchPlan(4, None, plan.proof)
    assert plan_batching(B8, d, requested=8, evidence_dir=path.parent).note is None
    big = plan_batching(B8, d, requested=16, evidence_dir=path.parent)
    assert big.max_rows == 8
    assert big.note == "16 rows requested, running 8: the decode graph has 8 rows"
    assert plan_batching(B8, d, requested=1, evidence_dir=path.parent) == BatchPlan(1)
    with pytest.raises(InvalidArgument):
        plan_batching(B8, d, requested=0, evidence_dir=path.parent)


def test_a_batch_1_manifest_plans_one_row_without_a_note(proven, tmp_path: Path) -> None:
    for directory in (proven[2].parent, tmp_path):
        assert plan_batching(TINY, SimDriver(TINY), requested=None,
                             evidence_dir=directory) == BatchPlan(1, None, None)
        assert plan_batching(TINY, SimDriver(TINY), requested=4,
                             evidence_dir=directory) == BatchPlan(1, None, None)


def test_without_evidence_one_row_and_the_note_says_why(tmp_path: Path) -> None:
    plan = plan_batching(B8, SimDriver(B8), requested=None, evidence_dir=tmp_path)
    assert plan.max_rows == 1 and plan.proof is None
    assert plan.note.startswith("batch graphs (max_batch 8): running 1 row per job: ")
    # one reason, said once for the three capabilities it holds for
    assert f"{', '.join(CAPS)} are claimed: claimed by the driver's declared " \
        "capabilities" in plan.note
    assert plan.note.count("no evidence") == 1
    assert f"no evidence for sim runtime 0.7.6 in {tmp_path}" in plan.note
    assert "examples/vendor/batch_semantics.py" in plan.note
    asked = plan_batching(B8, SimDriver(B8), requested=4, evidence_dir=tmp_path)
    assert asked.note.startswith("batch graphs (max_batch 8): 4 rows requested, running 1")


def test_stale_evidence_proves_nothing(proven, tmp_path: Path) -> None:
    data = json.loads(proven[2].read_text())
    data["runtime_version"] = "0.7.5"
    (tmp_path / "batch_semantics-sim-0.7.5.json").write_text(json.dumps(data))
    plan = plan_batching(B8, SimDriver(B8), requested=None, evidence_dir=tmp_path)
    assert plan.max_rows == 1
    assert "stale: batch_semantics-sim-0.7.5.json" in plan.note
    assert "is for runtime 0.7.5, this device runs 0.7.6" in plan.note
    # another device's evidence neither
    from calfsm.drivers.calrt import CalrtDriver
    shutil.copy(proven[2], tmp_path)
    with CalrtDriver.virtual(manifest_or_calbin=B8) as emu:
        plan = plan_batching(B8, emu, requested=None, evidence_dir=tmp_path)
    assert plan.max_rows == 1
    assert "batch_rows_independent" in plan.note and "is for device 'sim'" in plan.note


def test_a_driver_without_batch_calls_plans_one_row(proven) -> None:
    caps = Capabilities(resets=frozenset(ResetKind), parallel_mode=True,
                        fixed_engine_slots=True, engine_slots=2, batch_rows=False)
    plan = plan_batching(B8, SimDriver(B8, capabilities=caps), requested=None,
                         evidence_dir=proven[2].parent)
    assert plan == BatchPlan(1, "batch graphs (max_batch 8): running 1 row per job: driver "
                                "'sim' declares no batch calls (Capabilities.batch_rows)")
    plan = plan_batching(B8, NoBatchCalls(B8), requested=None, evidence_dir=proven[2].parent)
    assert plan.max_rows == 1 and "declares no batch calls" in plan.note


def test_evidence_without_max_rows_proves_no_row_count(proven, tmp_path: Path) -> None:
    data = json.loads(proven[2].read_text())
    del data["observations"]["max_rows"]
    (tmp_path / proven[2].name).write_text(json.dumps(data))
    plan = plan_batching(B8, SimDriver(B8), requested=None, evidence_dir=tmp_path)
    assert plan.max_rows == 1
    assert f"{proven[2].name} proves the batch capabilities but records no 'max_rows'" \
        in plan.note


@pytest.mark.timeout(180)
@pytest.mark.parametrize("driver", ["sim", "calrt"])
def test_a_bucket_calbin_proves_batching_up_to_its_widest_decode_graph(mod, tmp_path, driver):
    """tiny-buckets: one-row prefills, decode graphs up to 64 rows (issue 36). The
    prefills go one per job, the batch jobs are the decodes, F one decode token a row."""
    rc = mod.main(["--manifest", "tiny-buckets", "--driver", driver, "--out", str(tmp_path)])
    (path,) = tmp_path.glob("batch_semantics-*-0.7.6.json")
    ev = Evidence.load(path)
    assert rc == 0 and ev.complete and holds(ev) == ALL_HOLD, ev.verdicts
    assert ev.observations["max_rows"] == 64
    assert ev.verdicts["batch_mixed_rows"].reason.startswith("prefills of 64 rows")
