"""EvidenceStore: which file decides a capability, and the level and reason it gives for
missing, stale, failing, incomplete and unreadable evidence."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calfsm.drivers.base import Capabilities, ResetKind
from calfsm.drivers.sim import SimDriver
from calfsm.errors import InvalidArgument
from calfsm.plan import capabilities
from calfsm.plan.capabilities import (
    CAPABILITIES,
    Evidence,
    EvidenceStore,
    Level,
    Verdict,
    device_identity,
)
from calfsm.tools import cli

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


# ---- evidence that cannot be read proves nothing, raises nothing, blocks nothing ---------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner,
                                                                 max_size=3),
    max_leaves=8)


@given(field=st.sampled_from(["runner", "device", "driver", "runtime_version",
                              "calbin_sha256", "created_unix", "complete", "verdicts",
                              "settings", "files", "observations"]),
       value=JSON_VALUES)
def test_any_value_in_any_field_is_evidence_or_a_value_error(field: str, value: object
                                                             ) -> None:
    data = json.loads(Evidence("r", "dev", "0.7.6", "c" * 64, NOW, {}, {}).to_json())
    try:
        Evidence.from_dict({**data, field: value})
    except ValueError:
        pass


def _problem(directory: Path, name: str) -> str:
    """The one problem the store reports about ``name``; the answer names it too."""
    problems = EvidenceStore(directory).problems()
    assert len(problems) == 1 and problems[0].startswith(f"{name}: "), problems
    c = ask(directory)
    assert c.level is Level.UNKNOWN and problems[0] in c.reason, c.reason
    return problems[0]


@pytest.mark.parametrize(("field", "value", "why"), [
    ("settings", 5, "'settings' must be an object, got int"),
    ("files", {"trace": 3}, "'files' must map names to strings"),
    ("driver", ["sim"], "'driver' must be a string, got list"),
    ("complete", "yes", "'complete' must be a bool"),
    ("observations", [1], "'observations' must be an object"),
    ("verdicts", {CAP: 1}, "needs a bool 'holds'"),
])
def test_a_field_of_the_wrong_type_is_reported_not_raised(tmp_path: Path, field: str,
                                                          value: object, why: str) -> None:
    data = json.loads(write(tmp_path, "bad").read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**data, field: value}))
    problem = _problem(tmp_path, "bad.json")
    assert "not valid evidence" in problem and why in problem


def test_deep_json_is_reported_not_a_recursion_error(tmp_path: Path) -> None:
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "nested 100000 deep" in _problem(tmp_path, "deep.json")
    text = write(tmp_path, "deep").read_text()          # deep inside valid evidence
    deep = '{"x": ' * 5000 + "0" + "}" * 5000
    (tmp_path / "deep.json").write_text(text.replace('"observations": {',
                                                     f'"observations": {{"deep": {deep}, ', 1))
    assert "nested 5002 deep" in _problem(tmp_path, "deep.json")


def test_an_oversized_file_is_reported_unread(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "big")
    size = path.stat().st_size
    monkeypatch.setattr(capabilities, "MAX_FILE_BYTES", size - 1)
    assert f"{size} bytes, more than the {size - 1} allowed" in _problem(tmp_path, "big.json")
    monkeypatch.setattr(capabilities, "MAX_FILE_BYTES", size)
    assert ask(tmp_path).level is Level.PROVEN


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero", "dangling"])
def test_a_json_name_that_is_no_regular_file_neither_blocks_nor_raises(
        tmp_path: Path, kind: str) -> None:
    """A FIFO blocked the executor's start-up forever (open waits for a writer); a
    symlink to /dev/zero is a read that never ends."""
    path = tmp_path / "x.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero" if kind == "dev-zero" else tmp_path / "absent")
    write(tmp_path, "good")
    problem = {"fifo": "a FIFO, not a regular file",
               "directory": "a directory, not a regular file",
               "dev-zero": "a character device, not a regular file",
               "dangling": "No such file or directory"}[kind]
    problems = EvidenceStore(tmp_path).problems()
    assert problems == [f"x.json: unreadable: {problem}"]
    assert ask(tmp_path).level is Level.PROVEN          # the good file still decides


def test_the_executor_starts_beside_broken_evidence_and_says_why(tmp_path: Path) -> None:
    """A FIFO, and evidence with ``"settings": 5`` (a TypeError in the executor's
    start-up before): two asked, one run, the note naming both files."""
    from calfsm.executor import DeviceExecutor, ExecutorConfig
    from calfsm.manifest import builtin_manifest
    from tests.helpers.executor import write_evidence

    tiny = builtin_manifest("tiny")
    drv = SimDriver(tiny)
    path = write_evidence(tmp_path, drv)
    path.write_text(json.dumps({**json.loads(path.read_text()), "settings": 5}))
    os.mkfifo(tmp_path / "pipe.json")
    with DeviceExecutor(drv, tiny, ExecutorConfig(threaded=False, max_inflight=2,
                                                  evidence_dir=str(tmp_path))) as ex:
        h = ex.health()
    assert h.max_inflight == 1
    (note,) = h.notes
    assert "2 unreadable evidence file(s) ignored" in note
    assert "parallel.json: not valid evidence: 'settings' must be an object" in note
    assert "pipe.json: unreadable: a FIFO" in note
