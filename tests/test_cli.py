"""``calfsm run`` as a user meets it: bad options and input files exit 2 with one line on
stderr (never a traceback), start-up and device failures exit 3 saying why on stderr,
the summary on stdout accounts for every prompt and job tried, ``--help`` documents every
option and the exit codes, a built-in manifest name always means the built-in, and the
driver names come from the one registry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from calfsm import cli
from calfsm.drivers import registry
from calfsm.drivers.base import Capabilities
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.errors import Unavailable
from calfsm.executor import DeviceExecutor
from calfsm.manifest import builtin_manifest

SMALL = ("--manifest", "tiny", "--prompts", "2", "--sequences", "1", "--tokens", "2",
         "--quiet")
OPTIONS = ("--driver", "--manifest", "--faults", "--seed", "--latency", "--prompts",
           "--sequences", "--tokens", "--max-prompt", "--max-inflight", "--quiet")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["run", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def row(text: str, metric: str) -> str:
    m = re.search(rf"{re.escape(metric)}\s*│\s*(.*?)\s*│", text)
    assert m, f"no row {metric!r} in:\n{text}"
    return m.group(1)


def assert_usage_error(rc: int, out: str, err: str, *parts: str) -> None:
    """Exit 2, nothing on stdout, one line on stderr holding every part."""
    assert rc == cli.EXIT_USAGE, err
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("calfsm: error: "), err
    for part in parts:
        assert part in err, f"{part!r} not in {err!r}"


# ---- bad usage and input: exit 2 -------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_inflight_below_one_is_a_usage_error(capsys, value):
    rc, out, err = run(capsys, *SMALL, "--max-inflight", value)
    assert_usage_error(rc, out, err, f"--max-inflight: must be an integer >= 1, got {value}")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", ["real:decode_ms=nan", "real:decode_ms=inf",
                                  "real:decode_ms=-10", "real:prefill_token_us=-inf",
                                  "real:decode_ms=ten", "real:decode_ms"])
def test_latency_values_must_be_finite_and_not_negative(capsys, spec):
    rc, out, err = run(capsys, *SMALL, "--latency", spec)
    assert_usage_error(rc, out, err, f"--latency {spec}: ", "must be a finite number >= 0")


@pytest.mark.parametrize("driver", ["sim", "calrt"])
def test_a_fault_code_beyond_int32_is_refused_at_load(capsys, tmp_path, driver):
    """The cffi driver cannot carry a code above 2**31-1 (it raised OverflowError):
    the plan is refused when it is read, naming the rule, on every driver."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"point": "infer", "effect": "code", "code": 2**31}]))
    rc, out, err = run(capsys, *SMALL, "--driver", driver, "--faults", str(plan))
    assert_usage_error(rc, out, err, f"--faults {plan}: ", "rules[0].code", str(2**31))


@pytest.mark.parametrize(("content", "expected"), [
    ('[{"point": "infer"}]', "rules[0].effect: required field missing"),
    ('{"rules": [', "fault plan does not parse"),
    ('[{"point": "warp", "effect": "code"}]', "rules[0].point: unknown point 'warp'"),
])
def test_a_bad_fault_plan_file_is_a_usage_error_naming_the_file(capsys, tmp_path, content,
                                                                   expected):
    plan = tmp_path / "plan.json"
    plan.write_text(content)
    rc, out, err = run(capsys, *SMALL, "--faults", str(plan))
    assert_usage_error(rc, out, err, f"--faults {plan}: ", expected)


def test_a_manifest_wrong_by_meaning_exits_2_naming_the_field(capsys, tmp_path):
    data = builtin_manifest("tiny").to_dict()
    data["submodels"][1]["logits"]["dtype"] = "F16"
    path = tmp_path / "m.manifest.json"
    path.write_text(json.dumps(data))
    rc, out, err = run(capsys, *SMALL, "--manifest", str(path))
    assert_usage_error(rc, out, err, f"--manifest {path}: ", "submodels[1].logits.dtype")


# ---- --manifest: a built-in name is the built-in, a path is a file --------------------

def test_a_builtin_name_means_the_builtin_even_beside_a_file_of_that_name(
        capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny").write_text("not a manifest")
    rc, out, err = run(capsys, *SMALL)
    assert rc == cli.EXIT_OK, err
    assert "sim driver, tiny" in out
    rc, out, err = run(capsys, *SMALL[2:], "--manifest", "./tiny")
    assert_usage_error(rc, out, err, "--manifest ./tiny: ", "does not parse")


def test_a_name_neither_builtin_nor_a_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, *SMALL[2:], "--manifest", "qwen3")
    assert_usage_error(rc, out, err, "--manifest qwen3: not a built-in manifest "
                       "(qwen3-b1, tiny) and not a file")


# ---- --help ----------------------------------------------------------------------------

def test_help_explains_every_option_and_the_exit_codes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    rc, out, _ = run(capsys, "--help")
    assert rc == cli.EXIT_OK
    for option in OPTIONS:
        # the help text follows on the option's line or on the next, indented one
        m = re.search(rf"^  {re.escape(option)}( \S+)?(  +|\n +)(?P<help>\S[^\n]*)", out,
                      re.M)
        assert m and len(m["help"].split()) >= 3, f"{option} has no help text:\n{out}"
    assert re.search(r"^exit status:\n  0  the workload ran.*\n  2  bad usage or input"
                     r".*\n  3  the executor ended Failed", out, re.M), out
    assert "always means the built-in" in out and "./tiny" in out


# ---- where the output goes ---------------------------------------------------------------

def test_a_start_up_failure_goes_to_stderr_and_exits_3(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    FaultPlan.of(FaultRule.always("configure", "code")).save(plan)
    rc, out, err = run(capsys, *SMALL, "--faults", str(plan))
    assert rc == cli.EXIT_DEVICE_FAILED
    assert out == ""
    assert "calfsm: start-up failed: " in err and "INVALID_CALBIN" in err


def test_a_failed_executor_prints_the_summary_and_says_why_on_stderr(capsys, monkeypatch):
    def no_reset_driver(name, manifest, *, faults, seed, latency):
        plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=0))
        return SimDriver(manifest, faults=plan, capabilities=Capabilities(), trace=False)

    monkeypatch.setattr(cli, "build_driver", no_reset_driver)
    rc, out, err = run(capsys, *SMALL)
    assert rc == cli.EXIT_DEVICE_FAILED
    assert row(out, "lifecycle at end of workload") == "Failed"
    assert re.search(r"^calfsm: executor failed: \S", err, re.M), err


# ---- the summary accounts for every prompt and job ----------------------------------------

def test_the_summary_shows_jobs_refused_at_enqueue(capsys, monkeypatch):
    """The second job (the first prompt's first decode) is refused at enqueue: the first
    prompt fails, the other two complete, and the table says so row by row."""
    real_enqueue = DeviceExecutor.enqueue
    calls = []

    def enqueue(self, request):
        calls.append(request)
        if len(calls) == 2:
            raise Unavailable("admission paused", retry_after_s=0.0, stage="admission")
        return real_enqueue(self, request)

    monkeypatch.setattr(DeviceExecutor, "enqueue", enqueue)
    rc, out, err = run(capsys, "--manifest", "tiny", "--prompts", "3", "--sequences", "1",
                       "--tokens", "2", "--quiet")
    assert rc == cli.EXIT_OK, err
    assert row(out, "prompts completed / failed") == "2 / 1"
    assert row(out, "prompt failures by category") == "device: 1"
    assert row(out, "jobs enqueued") == str(len(calls)) == "8"
    assert row(out, "jobs refused at enqueue") == "device: 1"
    assert row(out, "succeeded / failed / cancelled / quarantined") == "7 / 0 / 0 / 0"
    assert row(out, "errors by category") == "none"
    assert row(out, "tokens generated") == "4"


def test_a_clean_run_accounts_for_every_prompt(capsys):
    rc, out, err = run(capsys, *SMALL)
    assert rc == cli.EXIT_OK, err
    assert err == ""
    assert row(out, "prompts completed / failed") == "2 / 0"
    assert row(out, "jobs enqueued") == "6"
    assert row(out, "jobs refused at enqueue") == "none"


# ---- one driver registry -------------------------------------------------------------------

def test_driver_names_come_from_the_registry(capsys, monkeypatch):
    monkeypatch.setitem(registry.BUILTIN, "sim2", "calfsm.drivers.sim:SimDriver")
    rc, out, err = run(capsys, *SMALL, "--driver", "sim2")
    assert rc == cli.EXIT_OK, err
    assert "sim2 driver, tiny" in out
    rc, out, err = run(capsys, *SMALL, "--driver", "nope")
    assert rc == cli.EXIT_USAGE and out == ""
    assert "invalid choice: 'nope'" in err and "'sim2'" in err
