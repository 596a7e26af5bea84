"""The vendor runners of examples/vendor/ on both shipped drivers: each runs to the end,
writes evidence whose verdicts match what the driver really does, and that evidence is
what EvidenceStore and ``calfsm capabilities`` read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calfsm.drivers.base import Capabilities, ResetKind
from calfsm.drivers.sim import SimDriver
from calfsm.manifest import builtin_manifest
from calfsm.plan.capabilities import Evidence, EvidenceStore, Level
from calfsm.tools import cli
from tests.helpers.vendor import runner

TINY_SHA = builtin_manifest("tiny").calbin_sha256
DEVICES = {"sim": "sim", "calrt": "calrt:libcalrt_emu.so"}

#: what each runner must find on the shipped drivers (both model the same device)
EXPECTED = {
    "parallel_mode": {"parallel_thread_safe": True, "parallel_two_in_flight": True,
                      "parallel_drain_on_close": True},
    "cancel_after_timeout": {"safe_cancel_after_timeout": False,
                             "timeout_recovery_by_reset": True},
    "kv_after_failed_wait": {"kv_no_partial_update": True},
    "reset_semantics": {"reset_ccu": True, "reset_configuration": True, "reset_full": True},
}


def run(name: str, out: Path, driver: str, *extra: str, given: SimDriver | None = None
        ) -> tuple[int, Evidence, Path]:
    rc = runner(name).main(["--manifest", "tiny", "--driver", driver, "--out", str(out),
                            *extra], driver=given)
    (path,) = out.glob(f"{name}-*-0.7.6.json")
    return rc, Evidence.load(path), path


@pytest.fixture(params=sorted(DEVICES))
def driver(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_runner_evidence_and_store_agree(name: str, driver: str, tmp_path: Path) -> None:
    rc, ev, path = run(name, tmp_path, driver)
    assert rc == 0
    assert ev.complete and ev.runner == name and ev.driver == driver
    assert (ev.device, ev.runtime_version, ev.calbin_sha256) == (DEVICES[driver], "0.7.6",
                                                                  TINY_SHA)
    assert ev.observations
    assert {k: v.holds for k, v in ev.verdicts.items()} == EXPECTED[name]
    raw = json.loads(path.read_text())
    assert raw["verdict"] == ("pass" if all(EXPECTED[name].values()) else "fail")
    summary = path.with_suffix(".md").read_text()
    for cap in EXPECTED[name]:
        assert f"`{cap}`" in summary
    store = EvidenceStore(tmp_path)
    for cap, holds in EXPECTED[name].items():
        c = store.capability(cap, device=DEVICES[driver], runtime_version="0.7.6",
                             calbin_sha256=TINY_SHA)
        assert c.level is (Level.PROVEN if holds else Level.FAILED)
        assert c.path == path and c.age_s is not None and c.age_s >= 0
        assert ev.verdicts[cap].reason in c.reason
        # the same file says nothing about another runtime version
        other = store.capability(cap, device=DEVICES[driver], runtime_version="0.7.7")
        assert other.level is Level.UNKNOWN and "stale" in other.reason


def test_overlap_verdict_follows_the_device(driver: str, tmp_path: Path) -> None:
    """Transfers of 0.2% of a job (the default latency) leave nothing to overlap; at 30%
    Ping/Pong pipelining shows, measured from the host on either driver."""
    rc, ev, path = run("overlap", tmp_path / "small", driver, "--rounds", "3")
    assert rc == 0 and ev.complete
    assert not ev.verdicts["pingpong_overlap"].holds
    assert ev.observations["gain"] < 0.01
    rc, ev, path = run("overlap", tmp_path / "big", driver, "--rounds", "3",
                       "--latency", "virtual:transfer_share=0.3")
    assert rc == 0 and ev.verdicts["pingpong_overlap"].holds
    assert ev.observations["gain"] >= 0.10 and ev.observations["wrong"] == 0
    # both shipped drivers report their phases: the PONG job's H2D ran during the PING
    # job's compute, and the PING job's D2H during the PONG job's compute
    assert ev.observations["device_timeline"] is True
    overlaps = ev.observations["phase_overlap_s"]
    assert overlaps["compute|h2d"] > 0 and overlaps["compute|d2h"] > 0
    trace = json.loads((path.parent / ev.files["chrome_trace"]).read_text())
    jobs = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert len(jobs) == len(ev.observations["jobs"]) == 12
    phases = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert {e["cat"] for e in phases} == {"h2d", "compute", "d2h"}
    assert all(e["dur"] > 0 for e in jobs)
    png = path.parent / ev.files["png_chart"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    store = EvidenceStore(path.parent)       # the trace JSON is not evidence
    assert store.problems() == []
    assert store.capability("pingpong_overlap", device=DEVICES[driver],
                            runtime_version="0.7.6").level is Level.PROVEN


def test_runner_that_cannot_observe_is_incomplete_and_proves_nothing(tmp_path: Path) -> None:
    # an execution deadline longer than the job: no wait ever fails
    rc, ev, _ = run("kv_after_failed_wait", tmp_path, "sim", "--exec-timeout-s", "10")
    assert rc == 1 and not ev.complete
    assert "kv_no_partial_update" not in ev.verdicts
    c = EvidenceStore(tmp_path).capability("kv_no_partial_update", device="sim",
                                           runtime_version="0.7.6")
    assert c.level is Level.UNKNOWN


def test_runner_bad_usage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mod = runner("overlap")
    assert mod.main(["--latency", "warp", "--out", str(tmp_path)]) == 2
    assert "--latency" in capsys.readouterr().err
    assert mod.main(["--latency", "virtual:transfer_share=1.5", "--out", str(tmp_path)]) == 2
    assert mod.main(["--timeout-s", "0", "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())


def test_cli_reads_what_the_runners_wrote(tmp_path: Path, capsys: pytest.CaptureFixture
                                          ) -> None:
    assert run("parallel_mode", tmp_path, "sim", "--steps", "5")[0] == 0
    capsys.readouterr()
    argv = ["capabilities", "--evidence-dir", str(tmp_path), "--manifest", "tiny", "--json"]
    assert cli.main(argv) == 0                       # parallel_two_in_flight is proven
    out = json.loads(capsys.readouterr().out)
    levels = {c["capability"]: c["level"] for c in out["capabilities"]}
    assert levels["parallel_two_in_flight"] == "proven"
    assert levels["pingpong_overlap"] == "claimed"   # the sim declares Ping/Pong
    assert levels["kv_no_partial_update"] == "unknown"
    assert cli.main([*argv, "--require", "pingpong_overlap"]) == 1
    assert "pingpong_overlap is not proven" in capsys.readouterr().err
    # the emulator is another device: the sim's evidence proves nothing there
    assert cli.main([*argv, "--driver", "calrt"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "calrt:libcalrt_emu.so"
    assert {c["level"] for c in out["capabilities"]} <= {"claimed", "unknown"}


def test_verdicts_come_from_what_the_device_does(tmp_path: Path) -> None:
    """A device with one engine, no parallel mode and only a CCU reset: the same runners
    find exactly that, and the store fails what it does not have."""
    caps = Capabilities(resets=frozenset({ResetKind.CCU}), parallel_mode=False,
                        fixed_engine_slots=False, engine_slots=1)

    def device() -> SimDriver:
        return SimDriver(builtin_manifest("tiny"), capabilities=caps, trace=False)

    rc, ev, _ = run("parallel_mode", tmp_path, "sim", given=device())
    assert rc == 0 and not any(v.holds for v in ev.verdicts.values())
    assert "UNSUPPORTED" in ev.verdicts["parallel_two_in_flight"].reason
    rc, ev, _ = run("overlap", tmp_path, "sim", given=device())
    assert rc == 0 and not ev.verdicts["pingpong_overlap"].holds
    rc, ev, _ = run("reset_semantics", tmp_path, "sim", given=device())
    assert rc == 0
    assert {k: v.holds for k, v in ev.verdicts.items()} == {
        "reset_ccu": True, "reset_configuration": False, "reset_full": False}
    assert "returned UNSUPPORTED" in ev.verdicts["reset_full"].reason
    assert "A DONE_ABORTED" in ev.verdicts["reset_ccu"].reason
    rc, ev, _ = run("cancel_after_timeout", tmp_path, "sim", given=device())
    # with nothing on another engine, a CCU reset ends the timed-out job and only it
    assert rc == 0 and ev.verdicts["safe_cancel_after_timeout"].holds
    assert "no job on another engine to spare" in ev.verdicts["safe_cancel_after_timeout"].reason
    store = EvidenceStore(tmp_path)
    levels = {c.name: c.level for c in store.capabilities(device="sim",
                                                          runtime_version="0.7.6")}
    assert levels["parallel_two_in_flight"] is Level.FAILED
    assert levels["pingpong_overlap"] is Level.FAILED
    assert levels["reset_full"] is Level.FAILED
    assert levels["reset_ccu"] is Level.PROVEN
    assert levels["kv_no_partial_update"] is Level.UNKNOWN


def test_the_executor_runs_two_in_flight_on_what_the_runner_wrote(driver: str,
                                                                 tmp_path: Path) -> None:
    """The parallel-mode runner's own file is what the executor reads: before it, a
    config asking for two runs one; after it, two, on the same kind of device."""
    from calfsm.drivers.calrt import CalrtDriver
    from calfsm.executor import DeviceExecutor, ExecutorConfig

    tiny = builtin_manifest("tiny")

    def executor() -> DeviceExecutor:
        dev = SimDriver(tiny) if driver == "sim" else CalrtDriver.virtual(
            manifest_or_calbin=tiny)
        return DeviceExecutor(dev, tiny, ExecutorConfig(
            threaded=False, max_inflight=2, evidence_dir=str(tmp_path)))

    with executor() as ex:
        assert ex.health().max_inflight == 1 and "no evidence" in ex.health().notes[0]
    rc, ev, _ = run("parallel_mode", tmp_path, driver)
    assert rc == 0 and ev.verdicts["parallel_two_in_flight"].holds
    with executor() as ex:
        h = ex.health()
        assert h.max_inflight == 2 and h.notes == (), h
