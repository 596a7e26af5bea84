"""``calfsm soak``: a short soak passes its gates and writes its report and plots; each
gate fails on the records it exists to catch (synthetic samples, and a leak injected
through the soak's observer seam); durations and usage errors."""

from __future__ import annotations

import json
import logging
import random

import attrs
import pytest

from calfsm import builtin_manifest
from calfsm.cli import main
from calfsm.drivers import load_driver
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.errors import (
    CalrtCode,
    DeadlineExceeded,
    ErrorCategory,
    IllegalTransition,
    Internal,
    InvalidArgument,
    Unavailable,
)
from calfsm.soak import SoakConfig, parse_duration, run_soak, soak_plan
from calfsm.soak_gates import (
    MIN_TREND_SAMPLES,
    GateLimits,
    Sample,
    Tally,
    evaluate,
    explain,
    rss_trend,
)
from calfsm.soak_plots import PLOTS

MIB = 1 << 20
PNG = b"\x89PNG\r\n\x1a\n"
#: the default test soak: long enough for ~100 samples and a few dozen recoveries
SHORT = "12s"


def _gates(report: dict) -> dict[str, bool]:
    return {g["name"]: g["passed"] for g in report["gates"]}


def test_short_soak_passes_its_gates_and_writes_report_and_plots(tmp_path, caplog):
    caplog.set_level(logging.CRITICAL)
    out = tmp_path / "soak"
    rc = main(["soak", "--duration", SHORT, "--seed", "3", "--manifest", "tiny",
               "--quiet", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert rc == 0, report["gates"]
    assert report["passed"] and all(_gates(report).values())
    assert set(_gates(report)) == {"rss", "leased", "device", "stuck", "once"}
    tally = report["tally"]
    # the soak exercised what it judges: every request kind, faults, recoveries
    assert set(tally["issued"]) == {"stream", "generate", "cancel", "bad"}
    assert sum(tally["fired"].values()) > 0 and tally["device_errors"] > 0
    samples = (out / "samples.csv").read_text().splitlines()
    assert len(samples) > 50
    last = dict(zip(samples[0].split(","), samples[-1].split(",")))
    assert int(last["recoveries"]) > 0 and int(last["leased"]) == 0
    assert any(k.startswith("cancelled") for k in tally["outcomes"]) and any(
        k.startswith("refused:request") for k in tally["outcomes"])
    assert "# calfsm soak: PASS" in (out / "report.md").read_text()
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name


def test_soak_on_the_native_emulator(tmp_path, caplog):
    caplog.set_level(logging.CRITICAL)
    out = tmp_path / "calrt"
    rc = main(["soak", "--driver", "calrt", "--duration", "4s", "--warmup", "1s",
               "--seed", "5", "--manifest", "tiny", "--quiet", "--no-plots",
               "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert rc == 0, report["gates"]
    assert report["tally"]["fired"] is None         # the emulator does not count faults
    assert report["tally"]["jobs"] > 100
    assert not list(out.glob("*.png"))


def test_a_leak_fails_the_rss_gate_and_nothing_else(caplog):
    """A leak injected through the public observer seam: every answer keeps 256 KiB."""
    caplog.set_level(logging.CRITICAL)
    manifest = builtin_manifest("tiny")
    driver = load_driver("sim", manifest_or_calbin=manifest, seed=1,
                         faults=soak_plan("swarm", 1, 4), trace=False)
    kept = []
    result = run_soak(SoakConfig(duration_s=4.0, warmup_s=1.0, sample_s=0.1), driver,
                      manifest, observer=lambda outcome, answer: kept.append(
                          bytearray(256 << 10)))
    gates = {g.name: g for g in result.gates}
    assert not gates["rss"].passed, gates["rss"].detail
    assert all(g.passed for name, g in gates.items() if name != "rss"), result.gates
    assert result.trend.growth > result.trend.tolerance


# ---- the gates on synthetic records --------------------------------------------------
def _samples(rss, *, dt=1.0, **kw):
    base = dict(leased=0, quarantined=0, generation=1, lifecycle="Ready", recoveries=0,
                faults=0, answered=0, open_requests=0, oldest_open_s=0.0, open_jobs=0)
    return [Sample(t=i * dt, rss=int(r), **(base | kw)) for i, r in enumerate(rss)]


def _clean_tally(**kw) -> Tally:
    t = Tally(jobs=10, jobs_answered=10, fired={}, **kw)
    t.issued["stream"] = 5
    t.outcomes["length"] = 5
    return t


LIMITS = GateLimits(warmup_s=10.0, stuck_s=5.0, rss_tolerance_mib=16.0,
                    rss_tolerance_pct=5.0)


def _passed(samples, tally) -> dict[str, bool]:
    return {g.name: g.passed for g in evaluate(samples, tally, LIMITS)}


def test_clean_records_pass_every_gate():
    rng = random.Random(0)
    rss = [100 * MIB + rng.randrange(-8 * MIB, 8 * MIB) for _ in range(100)]
    assert all(_passed(_samples(rss), _clean_tally()).values())


def test_rss_gate_judges_the_trend_after_warm_up_only():
    warm = [50 * MIB + i * 5 * MIB for i in range(10)]          # growth while warming
    flat = [100 * MIB] * 90
    assert _passed(_samples(warm + flat), _clean_tally())["rss"]
    leak = [100 * MIB + i * MIB // 2 for i in range(90)]        # 0.5 MiB/s for 89 s
    assert not _passed(_samples(warm + leak), _clean_tally())["rss"]
    trend = rss_trend(_samples(warm + leak), 10.0)
    assert trend.slope_bps == pytest.approx(MIB / 2)
    assert trend.growth == pytest.approx(89 * MIB / 2)


def test_rss_gate_ignores_a_spike_and_a_step_below_tolerance():
    rss = [100 * MIB] * 100
    rss[50] = 400 * MIB                                         # one wild sample
    assert _passed(_samples(rss), _clean_tally())["rss"]
    step = [100 * MIB] * 50 + [110 * MIB] * 50                  # one 10 MiB allocation
    assert _passed(_samples(step), _clean_tally())["rss"]


def test_rss_gate_needs_enough_samples():
    rss = [100 * MIB] * (10 + MIN_TREND_SAMPLES - 1)
    gate = next(g for g in evaluate(_samples(rss), _clean_tally(), LIMITS) if g.name == "rss")
    assert not gate.passed and "samples" in gate.detail


@pytest.mark.parametrize("change, gate", [
    (dict(leased_drained=1), "leased"),
    (dict(leased_closed=2), "leased"),
    (dict(unexplained_count=1, unexplained=["Internal: boom"]), "device"),
    (dict(final_state="Failed", failure_reason="reset failed"), "device"),
    (dict(idle_after_drain=False), "stuck"),
    (dict(open_requests=1), "stuck"),
    (dict(open_jobs=1), "stuck"),
    (dict(close_error="shutdown did not drain"), "stuck"),
    (dict(double_answers=1), "once"),
    (dict(token_mismatches=1), "once"),
    (dict(misanswered_bad=1), "once"),
    (dict(jobs_answered=9), "once"),
    (dict(open_at_end=1), "once"),
    (dict(open_jobs_at_end=1), "once"),
])
def test_each_gate_fails_on_what_it_guards(change, gate):
    tally = _clean_tally()
    for k, v in change.items():
        setattr(tally, k, v)
    if "open_requests" in change:
        tally.outcomes["length"] -= change["open_requests"]
        tally.open_at_end = change["open_requests"]
    if "open_jobs" in change:
        tally.jobs_answered -= change["open_jobs"]
        tally.open_jobs_at_end = change["open_jobs"]
    passed = _passed(_samples([100 * MIB] * 40), tally)
    assert not passed[gate]
    assert all(ok for name, ok in passed.items() if name != gate), passed


def test_device_gate_counts_against_the_faults_fired():
    tally = _clean_tally()
    tally.attributed["infer"] = 3
    tally.fired = {"infer": 2}
    assert not _passed(_samples([100 * MIB] * 40), tally)["device"]
    tally.fired = {"infer": 3}
    assert _passed(_samples([100 * MIB] * 40), tally)["device"]
    tally.fired = None                              # a driver that cannot count
    assert _passed(_samples([100 * MIB] * 40), tally)["device"]


def test_a_bug_only_the_executor_counted_fails_the_device_gate():
    tally = _clean_tally(executor_bugs=2, programming_errors=1)
    gate = next(g for g in evaluate(_samples([100 * MIB] * 40), tally, LIMITS)
                if g.name == "device")
    assert not gate.passed and "1 programming error" in gate.detail


def test_a_failed_executor_is_explained_only_by_failing_resets():
    tally = _clean_tally(final_state="Failed", failure_reason="reset full failed",
                         plan_fails_resets=True)
    assert _passed(_samples([100 * MIB] * 40), tally)["device"]


def test_a_stuck_request_seen_while_running_fails():
    samples = _samples([100 * MIB] * 40)
    samples[20] = attrs.evolve(samples[20], oldest_open_s=6.0, open_requests=1)
    assert not _passed(samples, _clean_tally())["stuck"]


# ---- explaining a job's error ------------------------------------------------------
CCU = FaultRule("infer", "ccu_exception", nth=1, every=10)
WAIT_CRASH = FaultRule("wait", "code", nth=1, every=10, code=int(CalrtCode.DEVICE_CRASHED))


def _device_error(stage, code=None, generation=2):
    return Unavailable("x", category=ErrorCategory.DEVICE, stage=stage, calrt_code=code,
                       generation=generation)


def test_explain_matches_an_error_to_the_rule_that_injects_it():
    assert explain(_device_error("status"), [CCU], 2) == "point:infer"
    assert explain(_device_error("status"), [WAIT_CRASH], 2) is None
    assert explain(_device_error("wait", 28), [WAIT_CRASH], 2) == "point:wait"
    assert explain(_device_error("wait", 28), [], 2) is None


def test_explain_what_is_not_a_device_exception():
    assert explain(Unavailable("recovering", stage="admission", retry_after_s=1.0), [], 2) \
        == "refusal"
    assert explain(_device_error("status", generation=1), [], 2) == "collateral"
    overtaken = Unavailable("the device was reset while the job was prepared",
                            stage="kv_seq", calrt_code=6, generation=2, retry_after_s=1.0)
    assert explain(overtaken, [], 2) == "collateral"
    assert explain(_device_error("kv_seq", 6), [], 2) is None
    assert explain(InvalidArgument("bad token"), [], 2) == "other"
    assert explain(DeadlineExceeded("late", stage="wait"), [], 2) == "other"
    assert explain(Internal("nan", stage="output"),
                   [FaultRule("infer", "nan", nth=1, every=5)], 2) == "point:infer"
    # a bug is never explained, whatever the plan injects
    assert explain(IllegalTransition("job", "Created", "complete"), [CCU, WAIT_CRASH], 2) is None


# ---- durations, plans, usage ---------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [("90s", 90), ("10m", 600), ("1h", 3600),
                                           ("250ms", 0.25), ("30", 30), ("1.5m", 90)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "0s", "-1m", "10x", "m", "1h30m", "nan"])
def test_parse_duration_refuses(text):
    with pytest.raises(InvalidArgument, match="duration"):
        parse_duration(text)


def test_swarm_plan_is_seeded_never_empty_and_aimed_at_the_clients():
    a = soak_plan("swarm", 7, 3)
    assert a == soak_plan("swarm", 7, 3) and a.rules
    assert all(r.seq_id in (None, 0, 1, 2) for r in a.rules)
    assert not any(r.point == "reset"
                   for s in range(50) for r in soak_plan("swarm", s, 3).rules)
    assert soak_plan("none", 7, 3) == FaultPlan.none()


@pytest.mark.parametrize("argv, message", [
    (["--duration", "ten"], "duration"),
    (["--duration", "10s", "--warmup", "10s"], "--warmup"),
    (["--kinds", "no_such_kind"], "unknown swarm kind"),
    (["--fault-rate", "0"], "--fault-rate"),
    (["--clients", "0"], "--clients"),
    (["--manifest", "./nowhere.json"], "--manifest"),
])
def test_usage_errors_exit_2_with_one_line(argv, message, capsys, tmp_path):
    assert main(["soak", *argv, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("calfsm: error:")
    assert not (tmp_path / "report.json").exists()
