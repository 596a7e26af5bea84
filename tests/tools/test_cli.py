"""``calfsm run`` as a user meets it: bad options and input files exit 2 with one line on
stderr (never a traceback), start-up and device failures exit 3 saying why on stderr,
the summary on stdout accounts for every prompt and job tried, ``--help`` documents every
option and the exit codes, a built-in manifest name always means the built-in, and the
driver names come from the one registry."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from calfsm.drivers import registry
from calfsm.drivers.base import Capabilities
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.engine.face import JobFace
from calfsm.engine.lifecycle import Lifecycle
from calfsm.errors import Unavailable
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import builtin_manifest
from calfsm.tools import cli
from calfsm.tools.direct import DirectRunner

SMALL = ("--manifest", "tiny", "--prompts", "2", "--sequences", "1", "--tokens", "2",
         "--quiet")
OPTIONS = ("--driver", "--manifest", "--faults", "--seed", "--latency", "--path",
           "--prompts", "--sequences", "--tokens", "--max-prompt", "--max-inflight",
           "--evidence-dir", "--temperature", "--top-k", "--top-p", "--sampling-seed",
           "--resume", "--quiet")
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=5)


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

@pytest.mark.parametrize(("argv", "expected"), [
    (("--temperature", "-1"), "--temperature -1.0: temperature must be >= 0"),
    (("--temperature", "nan"), "--temperature nan: temperature must be finite"),
    (("--top-k", "-3"), "--top-k -3: top_k must be >= 0, got -3"),
    (("--top-p", "0"), "--top-p 0.0: top_p must be in (0, 1]"),
    (("--top-p", "1.5"), "--top-p 1.5: top_p must be in (0, 1]"),
    (("--temperature", "1", "--sampling-seed", "-1"), "--sampling-seed -1: seed must be >= 0"),
    (("--temperature", "1", "--seed", "-2"), "--seed -2: seed must be >= 0"),
    (("--path", "jobs", "--resume"), "--resume applies to --path streams only"),
])
def test_a_bad_sampling_or_path_option_is_a_usage_error_naming_it(capsys, argv, expected):
    rc, out, err = run(capsys, *SMALL, *argv)
    assert_usage_error(rc, out, err, expected)


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


def test_latency_transfer_share_reaches_the_device_and_stays_below_one(capsys):
    from calfsm.manifest import builtin_manifest
    from calfsm.tools.cli import build_driver
    with build_driver("sim", builtin_manifest("tiny"), faults=None, seed=0,
                      latency="real:decode_ms=5,transfer_share=0.3") as d:
        assert d.latency.transfer_share == 0.3 and not d.clock.virtual
    rc, out, err = run(capsys, *SMALL, "--latency", "real:transfer_share=1")
    assert_usage_error(rc, out, err, "--latency real:transfer_share=1: ", "transfer_share")


def test_real_latency_models_a_static_calbin_unless_told_rows(capsys):
    # issue 36: a static calbin computes its graph's whole shape, so the command line's
    # real device prices steps by the graph unless shape_cost=rows says otherwise
    from calfsm.tools.cli import build_driver
    for spec, cost in (("real:decode_ms=5", "graph"), ("real:shape_cost=rows", "rows"),
                       ("real:shape_cost=graph,context_token_ns=20", "graph")):
        with build_driver("sim", builtin_manifest("tiny"), faults=None, seed=0,
                          latency=spec) as d:
            assert d.latency.shape_cost == cost
    with build_driver("sim", builtin_manifest("tiny"), faults=None, seed=0,
                      latency="real:context_token_ns=20") as d:
        assert d.latency.context_token_s == pytest.approx(20e-9)
    rc, out, err = run(capsys, *SMALL, "--latency", "real:shape_cost=dynamic")
    assert_usage_error(rc, out, err, "--latency real:shape_cost=dynamic: ", "rows, graph")


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
                       "(qwen3-b1, tiny, qwen3-b8, tiny-b8, qwen3-buckets, tiny-buckets) "
                       "and not a file")


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
    flat = " ".join(out.split())            # argparse wraps the help text
    assert "always means the built-in" in flat and "./tiny" in flat


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

@pytest.mark.parametrize("path", cli.PATHS)
def test_the_summary_shows_jobs_refused_at_enqueue(capsys, monkeypatch, path):
    """The second job (the first prompt's first decode) is refused at enqueue: the first
    prompt fails, the other two complete, and the table says so row by row. The refusal
    is made at the lifecycle's gate, which every job tried passes once (the jobs path's
    ``enqueue``, a stream's steps); with nothing prepared ahead (``stage`` says it
    cannot), every step of a stream is a job tried."""
    calls = []
    real_gate = Lifecycle.gate
    unset = object()

    def gate(self, *, continuing=unset):
        if continuing is unset:             # opening a sequence, not a job tried
            return real_gate(self)
        calls.append(continuing)            # every job tried passes the gate once
        if len(calls) == 2:
            raise Unavailable("admission paused", retry_after_s=0.0, stage="admission")
        return real_gate(self, continuing=continuing)

    monkeypatch.setattr(Lifecycle, "gate", gate)
    monkeypatch.setattr(JobFace, "stage", lambda self, request: None)
    rc, out, err = run(capsys, "--manifest", "tiny", "--prompts", "3", "--sequences", "1",
                       "--tokens", "2", "--quiet", "--path", path)
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


# ---- --path: streams (the default) and the per-job loop -------------------------------------

def _workload(path: str, sampling: SamplingParams | None = None, *, faults=None,
              resume: bool = False, prompts: int = 4, sequences: int = 2,
              tokens: int = 5) -> dict:
    manifest = builtin_manifest("tiny")
    driver = SimDriver(manifest, seed=0, trace=False, faults=faults)
    with DeviceExecutor(driver, manifest, ExecutorConfig()) as ex:
        return cli.run_workload(ex, prompts=prompts, sequences=sequences, tokens=tokens,
                                seed=3, max_prompt=40, path=path, sampling=sampling,
                                resume=resume)


def test_streams_is_the_default_path_and_enqueues_no_job_by_hand(capsys, monkeypatch):
    entries = {"enqueue": 0, "open_sequence": 0}
    for name in entries:
        real = getattr(DeviceExecutor, name)

        def spy(self, *a, _name=name, _real=real, **kw):
            entries[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(DeviceExecutor, name, spy)
    rc, out, err = run(capsys, *SMALL)
    assert rc == cli.EXIT_OK, err
    assert row(out, "path") == "streams"
    assert row(out, "sampling: temperature / top-k / top-p") == "greedy"
    assert entries == {"enqueue": 0, "open_sequence": 2}      # one sequence per prompt
    rc, out, err = run(capsys, *SMALL, "--path", "jobs")
    assert rc == cli.EXIT_OK, err
    assert row(out, "path") == "jobs"
    assert entries == {"enqueue": 2 + 2 * 2, "open_sequence": 2}


def test_both_paths_generate_the_reference_models_greedy_tokens():
    streams, jobs = _workload("streams"), _workload("jobs")
    assert streams["outputs"] == jobs["outputs"]
    manifest = builtin_manifest("tiny")
    runner = DirectRunner(SimDriver(manifest, trace=False), manifest)
    rng = random.Random(3)                  # the prompts run_workload draws from seed 3
    for index in range(4):
        prompt = [rng.randrange(1024) for _ in range(rng.randint(1, 40))]
        assert list(streams["outputs"][index]) == runner.generate(0, prompt, 6), index
    assert streams["prompts_completed"] == jobs["prompts_completed"] == 4
    assert streams["tokens"] == jobs["tokens"] == 4 * 5     # decoded, after the first


def test_sampling_is_seeded_per_prompt_and_the_same_on_both_paths():
    streams = _workload("streams", SAMPLED)
    assert streams["outputs"] == _workload("jobs", SAMPLED)["outputs"]
    assert streams["outputs"] == _workload("streams", SAMPLED)["outputs"]
    other_seed = _workload("streams", attrs.evolve(SAMPLED, seed=6))["outputs"]
    greedy = _workload("streams")["outputs"]
    assert streams["outputs"] != other_seed and streams["outputs"] != greedy
    # prompt i draws from seed + i: prompt 1 of seed 5 is prompt 0 of seed 6's stream
    assert cli.prompt_params(SAMPLED, 1, 5) == attrs.evolve(SAMPLED, seed=6, max_tokens=6)


def test_sampling_options_reach_the_table(capsys):
    rc, out, err = run(capsys, *SMALL, "--temperature", "0.8", "--top-k", "50",
                       "--top-p", "0.9", "--sampling-seed", "5")
    assert rc == cli.EXIT_OK, err
    assert row(out, "sampling: temperature / top-k / top-p") == "0.8 / 50 / 0.9"
    assert row(out, "sampling seed (prompt i: seed + i)") == "5"
    rc, out, err = run(capsys, *SMALL, "--temperature", "1", "--seed", "7", "--resume")
    assert rc == cli.EXIT_OK, err
    assert row(out, "path") == "streams, resume"
    assert row(out, "sampling: temperature / top-k / top-p") == "1 / off / off"
    assert row(out, "sampling seed (prompt i: seed + i)") == "7"


def _ms(text: str, metric: str) -> float:
    value = row(text, metric)
    assert value.endswith(" ms"), value
    return float(value.removesuffix(" ms"))


@pytest.mark.parametrize("path", cli.PATHS)
def test_the_table_shows_time_to_first_token_and_per_output_token(capsys, path):
    """On the virtual clock a decode takes 10 ms of device time (plus its tiny DMA) and
    host work takes none: one sequence gets a token every 10 ms, after a first token
    that took its prefill's time (at most 40 tokens of 0.2 ms)."""
    clock = "(virtual device time)"
    rc, out, err = run(capsys, "--manifest", "tiny", "--prompts", "4", "--tokens", "8",
                       "--sequences", "1", "--max-prompt", "40", "--quiet", "--path", path)
    assert rc == cli.EXIT_OK, err
    assert row(out, "tokens generated") == "32"
    assert 0 < _ms(out, f"P50 time to first token {clock}") \
        <= _ms(out, f"P99 time to first token {clock}") < 10.0
    for q in ("P50", "P99"):
        assert _ms(out, f"{q} time per output token {clock}") == pytest.approx(10.0, abs=0.01)
    assert _ms(out, f"P50 decode job time {clock}") >= 10.0


def test_no_token_is_not_a_time_of_zero(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    FaultPlan.of(FaultRule.always("infer", "code", code=-5, seq_id=0)).save(plan)
    rc, out, err = run(capsys, *SMALL, "--faults", str(plan))
    assert rc == cli.EXIT_OK, err
    assert row(out, "prompts completed / failed") == "0 / 2"
    assert row(out, "tokens generated") == "0"
    assert row(out, "P50 time to first token (virtual device time)") == "n/a"
    assert row(out, "P99 time per output token (virtual device time)") == "n/a"


def test_resume_replays_a_stream_whose_kv_a_reset_lost():
    """A device exception in prompt 0's third step resets the device: without --resume
    the prompt fails with the tokens it had (prompt 1 may fail too, if it starts while
    the device recovers); with it the stream replays on the new generation and every
    prompt gives the tokens of a fault-free run."""
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", nth=3, seq_id=0))
    clean = _workload("streams", prompts=2, sequences=1)
    failed = _workload("streams", faults=plan, prompts=2, sequences=1)
    assert failed["prompts_completed"] < 2 and set(failed["errors"]) == {"device"}
    assert failed["outputs"][0] == clean["outputs"][0][:2]
    resumed = _workload("streams", faults=plan, resume=True, prompts=2, sequences=1)
    assert resumed["prompts_completed"] == 2 and resumed["errors"] == {}
    assert resumed["outputs"] == clean["outputs"]


# ---- what the executor could not honour is said, not silent ------------------------------

def test_max_inflight_two_without_evidence_says_it_runs_one_and_why(capsys, tmp_path):
    """Before issue 20, ``--max-inflight 2`` silently ran one: the reason was only in
    ``health().notes`` and a log line below the CLI's level."""
    rc, out, err = run(capsys, *SMALL, "--max-inflight", "2", "--evidence-dir",
                       str(tmp_path))
    assert rc == cli.EXIT_OK
    notes = [line for line in err.splitlines() if line.startswith("calfsm: note: ")]
    assert len(notes) == 1, err
    assert "max_inflight=2 requested, running 1: parallel_two_in_flight is claimed" \
        in notes[0] and f"no evidence for sim runtime 0.7.6 in {tmp_path}" in notes[0]
    assert row(out, "jobs in flight: asked / running") == "2 / 1"
    assert row(out, "note").startswith("max_inflight=2 requested, running 1:")
    rc, out, err = run(capsys, *SMALL)
    assert "note" not in err and row(out, "jobs in flight: asked / running") == "1 / 1"


# ---- a seed is a run: the same table every time on the virtual clock -----------------------

def _table_of_a_fresh_process(*argv: str, hash_seed: str) -> str:
    """``calfsm run`` in a process of its own (its own thread timing, its own string
    hashing: nothing carried over from this one); the table it prints."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "COLUMNS": "120"}
    done = subprocess.run([sys.executable, "-m", "calfsm.tools.cli", "run", *argv],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == cli.EXIT_OK, done.stderr
    return done.stdout


@pytest.mark.parametrize("path", cli.PATHS)
def test_the_same_swarm_seed_prints_the_same_table_every_time(path):
    """Before issue 20 four request threads raced for the device: which job met which
    fault (rules fire by call ordinal) changed from run to run, and with it every row.
    On the virtual clock ``calfsm run`` now runs in step mode, interleaved by a
    StepScheduler seeded from --seed: nothing is left to the OS scheduler."""
    argv = ("--manifest", "tiny", "--prompts", "8", "--sequences", "4", "--tokens", "8",
            "--faults", "swarm", "--seed", "3", "--quiet", "--path", path)
    first = _table_of_a_fresh_process(*argv, hash_seed="1")
    assert row(first, "errors by category") != "none"      # the faults did fire
    assert row(first, "tokens/s (virtual device time)")     # no wall-time row left
    assert _table_of_a_fresh_process(*argv, hash_seed="2") == first
    assert _table_of_a_fresh_process(*argv, hash_seed="1") == first


@pytest.mark.parametrize("driver", ["sim", "calrt"])
def test_a_manifest_for_another_runtime_version_is_a_usage_error(capsys, tmp_path, driver):
    data = builtin_manifest("tiny").to_dict() | {"calrt_version": "0.8.0"}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    rc, out, err = run(capsys, "--manifest", str(path), "--driver", driver, "--quiet")
    assert_usage_error(rc, out, err, f"--manifest {path}: calrt_version: the manifest's "
                       "calbin is built for CalRT 0.8.0, the device runs CalRT 0.7.6")


# ---- deep JSON in a manifest or a fault plan: exit 2, one line, from every command ---------

@pytest.mark.parametrize("command", [
    ("run", "--manifest"), ("run", "--faults"), ("capabilities", "--manifest"),
    ("serve", "--manifest"), ("serve", "--faults"), ("soak", "--manifest"),
    ("soak", "--faults"), ("parallel_mode.py", "--manifest")])
def test_deep_json_in_any_loaded_file_exits_2_with_one_line(capsys, tmp_path, command):
    """Before issue 20: exit 1 and a RecursionError traceback."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    name, option = command
    if name.endswith(".py"):
        from tests.helpers.vendor import runner
        rc = runner(name.removesuffix(".py")).main([option, str(deep)])
    else:
        rc = cli.main([name, option, str(deep)])
    out, err = capsys.readouterr()
    assert rc == cli.EXIT_USAGE, err
    assert err.count("\n") == 1 and "nested 100000 deep, more than the 64 allowed" in err, err
    assert "Traceback" not in out + err
