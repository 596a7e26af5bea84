"""EvidenceStore: which file decides a capability, and the level and reason it gives for
missing, stale, failing, incomplete and unreadable evidence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calfsm import cli
from calfsm.capabilities import (
    CAPABILITIES,
    Evidence,
    EvidenceStore,
    Level,
    Verdict,
    device_identity,
)
from calfsm.drivers.base import Capabilities, ResetKind
from calfsm.drivers.sim import SimDriver
from calfsm.errors import InvalidArgument

NOW = 1_800_000_000.0
CAP = "parallel_two_in_flight"


def write(directory: Path, stem: str, *, holds: bool = True, device: str = "dev",
          runtime: str = "0.7.6", calbin: str = "c" * 64, age_s: float = 60.0,
          complete: bool = True, cap: str = CAP) -> Path:
    ev = Evidence(runner="parallel_mode", device=device, runtime_version=runtime,
                  calbin_sha256=calbin, created_unix=NOW - age_s,
                  observations={"max_in_flight": 2},
                  verdicts={cap: Verdict(holds, f"{stem} says {holds}")}, complete=complete)
    path = directory / f"{stem}.json"
    path.write_text(ev.to_json())
    return path


def ask(directory: Path | None, **kw) -> object:
    kw = {"device": "dev", "runtime_version": "0.7.6", "now": NOW} | kw
    return EvidenceStore(directory).capability(CAP, **kw)


def test_missing_evidence_is_unknown_and_names_the_runner(tmp_path: Path) -> None:
    c = ask(tmp_path)
    assert c.level is Level.UNKNOWN and c.path is None and c.age_s is None
    assert "no evidence" in c.reason and "examples/vendor/parallel_mode.py" in c.reason
    assert ask(None).level is Level.UNKNOWN            # no directory at all
    assert ask(tmp_path / "absent").level is Level.UNKNOWN


def test_declared_feature_without_proof_is_claimed(tmp_path: Path) -> None:
    declared = Capabilities(resets=frozenset(ResetKind), parallel_mode=True,
                            fixed_engine_slots=True, engine_slots=2)
    c = ask(tmp_path, declared=declared)
    assert c.level is Level.CLAIMED and "claimed" in c.reason and "not proven" in c.reason
    assert ask(tmp_path, declared=Capabilities()).level is Level.UNKNOWN
    # no declaration can claim a safe cancel
    c = EvidenceStore(tmp_path).capability("safe_cancel_after_timeout", device="dev",
                                           runtime_version="0.7.6", declared=declared)
    assert c.level is Level.UNKNOWN


def test_passing_evidence_proves_with_file_and_age(tmp_path: Path) -> None:
    path = write(tmp_path, "good", age_s=90.0)
    c = ask(tmp_path)
    assert c.level is Level.PROVEN and c.proven
    assert c.path == path and c.age_s == pytest.approx(90.0)
    assert "proven by good.json" in c.reason and "1.5 min ago" in c.reason
    assert "good says True" in c.reason
    assert c.evidence.observations == {"max_in_flight": 2}


def test_failing_evidence_is_failed(tmp_path: Path) -> None:
    write(tmp_path, "bad", holds=False)
    c = ask(tmp_path)
    assert c.level is Level.FAILED and "does not hold" in c.reason
    assert "bad says False" in c.reason


@pytest.mark.parametrize(("kw", "why"), [
    ({"runtime": "0.7.5"}, "is for runtime 0.7.5, this device runs 0.7.6"),
    ({"device": "other"}, "is for device 'other', this is 'dev'"),
    ({"calbin": "d" * 64}, "is for calbin dddddddddddd..."),
    ({"age_s": 7200.0}, "is older than the 1.0 h allowed"),
])
def test_stale_evidence_proves_nothing(tmp_path: Path, kw: dict, why: str) -> None:
    write(tmp_path, "old", **kw)
    c = ask(tmp_path, calbin_sha256="c" * 64, max_age_s=3600.0)
    assert c.level is Level.UNKNOWN
    assert c.reason.startswith("stale: old.json") and why in c.reason
    declared = Capabilities(parallel_mode=True, fixed_engine_slots=True, engine_slots=2)
    c = ask(tmp_path, calbin_sha256="c" * 64, max_age_s=3600.0, declared=declared)
    assert c.level is Level.CLAIMED and why in c.reason


def test_any_calbin_unless_one_is_asked_for(tmp_path: Path) -> None:
    write(tmp_path, "other-calbin", calbin="d" * 64)
    assert ask(tmp_path).level is Level.PROVEN
    assert ask(tmp_path, calbin_sha256="c" * 64).level is Level.UNKNOWN


def test_newest_fresh_evidence_decides(tmp_path: Path) -> None:
    write(tmp_path, "a-older-pass", holds=True, age_s=600)
    write(tmp_path, "b-newer-fail", holds=False, age_s=60)
    write(tmp_path, "c-newest-stale", holds=True, age_s=1, runtime="0.7.5")
    c = ask(tmp_path)
    assert c.level is Level.FAILED and c.path.name == "b-newer-fail.json"


def test_incomplete_evidence_proves_nothing_but_a_failure_counts(tmp_path: Path) -> None:
    write(tmp_path, "partial", holds=True, complete=False)
    c = ask(tmp_path)
    assert c.level is Level.UNKNOWN and "incomplete: partial.json" in c.reason
    write(tmp_path, "partial-fail", holds=False, complete=False, age_s=1)
    assert ask(tmp_path).level is Level.FAILED


def test_other_json_is_skipped_and_broken_evidence_reported(tmp_path: Path) -> None:
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "broken.json").write_text(json.dumps({"schema": "calfsm-evidence/1"}))
    (tmp_path / "garbage.json").write_text("{not json")
    store = EvidenceStore(tmp_path)
    problems = store.problems()
    assert len(problems) == 2
    assert any(p.startswith("broken.json: not valid evidence") for p in problems)
    assert any(p.startswith("garbage.json: unreadable") for p in problems)
    assert ask(tmp_path).level is Level.UNKNOWN


def test_directory_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    write(tmp_path, "env")
    monkeypatch.setenv("CALFSM_EVIDENCE_DIR", str(tmp_path))
    assert EvidenceStore().directory == tmp_path
    assert EvidenceStore().capability(CAP, device="dev", runtime_version="0.7.6",
                                      now=NOW).level is Level.PROVEN


def test_every_capability_answered_and_unknown_names_refused(tmp_path: Path) -> None:
    answers = EvidenceStore(tmp_path).capabilities(device="dev", runtime_version="0.7.6")
    assert [c.name for c in answers] == [c.name for c in CAPABILITIES]
    assert all(c.question for c in answers)
    with pytest.raises(InvalidArgument, match="unknown capability 'teleport'"):
        EvidenceStore(tmp_path).capability("teleport", device="dev", runtime_version="0")


def test_evidence_round_trips_and_rejects_bad_records(tmp_path: Path) -> None:
    path = write(tmp_path, "rt")
    ev = Evidence.load(path)
    assert Evidence.from_dict(json.loads(ev.to_json())) == ev
    data = json.loads(path.read_text())
    for broken in ({**data, "runtime_version": 7}, {**data, "created_unix": "now"},
                   {**data, "verdicts": {CAP: {"holds": "yes", "reason": ""}}},
                   {**data, "schema": "other"}):
        with pytest.raises(ValueError):
            Evidence.from_dict(broken)


def test_device_identity_names_the_driver() -> None:
    with SimDriver() as d:
        assert device_identity(d) == "sim"


def test_cli_exit_codes_without_a_device(tmp_path: Path, capsys: pytest.CaptureFixture
                                         ) -> None:
    write(tmp_path, "good", age_s=1)
    base = ["capabilities", "--evidence-dir", str(tmp_path), "--device", "dev",
            "--runtime-version", "0.7.6"]
    assert cli.main(base) == 0                                  # the default: two in flight
    assert "parallel_two_in_flight" in capsys.readouterr().out
    assert cli.main([*base, "--runtime-version", "0.7.5"]) == 1
    assert "not proven" in capsys.readouterr().err
    assert cli.main([*base, "--require", "all"]) == 1
    assert cli.main([*base, "--require", "none"]) == 0
    assert cli.main([*base, "--require", "teleport"]) == 2
    assert "unknown capability" in capsys.readouterr().err
    assert cli.main([*base, "--max-age-s", "-1"]) == 2
    assert cli.main(["capabilities", "--manifest", str(tmp_path / "absent.json")]) == 2
