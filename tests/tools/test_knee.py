"""The knee search (calfsm/tools/knee.py) on synthetic attainment(rate) curves, where the
knee is known exactly, and the Poisson load it drives on a step-mode executor."""

from __future__ import annotations

import pytest

from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.manifest import builtin_manifest
from calfsm.tools.knee import PoissonLoad, find_knee, sweep_knee


def curve(knee: float, width: float = 0.3):
    """Attainment 1 up to ``knee * (1 - width)``, then falling linearly through 0.9 at
    ``knee``: the shape the executor shows (see bench/bench_knee.py)."""
    start = knee * (1 - width)

    def attainment(rate: float) -> float:
        if rate <= start:
            return 1.0
        return max(0.0, 1.0 - 0.1 * (rate - start) / (knee - start))
    return attainment


@pytest.mark.parametrize("knee", [0.37, 1.0, 3.77, 12.5, 640.0])
@pytest.mark.parametrize("start_over_knee", [0.26, 0.5, 0.9, 1.0, 1.1, 1.9, 3.9])
def test_the_search_lands_within_5_percent_in_8_runs(knee: float,
                                                     start_over_knee: float) -> None:
    calls: list[float] = []

    def measure(rate: float) -> float:
        calls.append(rate)
        return curve(knee)(rate)
    found = find_knee(measure, start=knee * start_over_knee, target=0.9)
    assert found.runs == len(calls) <= 8
    assert found.rate is not None and found.high is not None
    assert found.rate <= knee < found.high          # a passing rate, below a failing one
    assert found.rate >= 0.95 * knee, found.probes


def test_the_search_and_a_fine_sweep_agree() -> None:
    knee = 3.77
    measure = curve(knee)
    sweep = sweep_knee(measure, [0.5 + 0.01 * k for k in range(600)], target=0.9)
    search = find_knee(measure, start=3.0, target=0.9)
    assert sweep.rate == pytest.approx(3.77)
    assert abs(search.rate / sweep.rate - 1) <= 0.05 and search.runs <= 8
    assert sweep.runs > 8 * search.runs / 2          # what the search saves


def test_a_step_curve_and_its_bisection_path() -> None:
    """Deterministic: attainment 1 below 5, 0 from 5 on; from 4: 4 passes, 8 fails, then
    6, 5 fail, 4.5, 4.75, 4.875 pass (bracket within 4% of 4.875: 0.125 / 4.875)."""
    found = find_knee(lambda r: 1.0 if r < 5 else 0.0, start=4.0)
    assert [p.rate for p in found.probes] == [4.0, 8.0, 6.0, 5.0, 4.5, 4.75, 4.875]
    assert [p.passed for p in found.probes] == [True, False, False, False, True, True, True]
    assert (found.rate, found.high) == (4.875, 5.0)


def test_no_rate_passes_or_none_fails() -> None:
    nothing = find_knee(lambda r: 0.0, start=1.0, max_runs=8)
    assert nothing.rate is None and nothing.runs == 8
    assert nothing.probes[-1].rate == pytest.approx(1 / 2 ** 7)
    everything = find_knee(lambda r: 1.0, start=1.0, max_runs=5)
    assert everything.rate == 16.0 and everything.high is None
    capped = find_knee(lambda r: 1.0, start=1.0, max_rate=3.0)
    assert capped.rate == 3.0 and capped.runs == 3


@pytest.mark.parametrize("bad", [dict(start=0.0), dict(target=0.0), dict(target=1.5),
                                 dict(max_runs=0), dict(factor=1.0)])
def test_bad_search_arguments(bad: dict) -> None:
    kw = dict(start=1.0) | bad
    with pytest.raises(InvalidArgument):
        find_knee(lambda r: 1.0, **kw)


def _run(rate: float, load: PoissonLoad, slos: dict[str, float]):
    manifest = builtin_manifest("tiny")
    driver = SimDriver(manifest, seed=0, trace=False,
                       latency=LatencyModel.fixed(decode_s=0.010, prefill_per_token_s=5e-5))
    with DeviceExecutor(driver, manifest, ExecutorConfig(threaded=False)) as ex:
        return load.run(ex, rate, slos)


def test_the_poisson_load_is_deterministic_and_answers_every_request() -> None:
    load = PoissonLoad(requests=24, output_tokens=(4, 8), seed=3)
    slos = {"ttft": 200.0, "tpot": 40.0}
    light = _run(1.0, load, slos)
    assert light.requests == 24 and light.errors == 0
    assert light.attainment["all"] == 1.0
    assert light.output_tokens == sum(n for _, _, n in load.workload(1024))
    assert _run(1.0, load, slos) == light             # a seed is a run
    heavy = _run(40.0, load, slos)                     # far past the device's ~12/s
    assert heavy.attainment["all"] < light.attainment["all"]
    assert heavy.percentiles["tpot"][50] > light.percentiles["tpot"][50]


def test_the_poisson_load_needs_a_step_mode_executor() -> None:
    manifest = builtin_manifest("tiny")
    with DeviceExecutor(SimDriver(manifest, seed=0, trace=False), manifest,
                        ExecutorConfig(threaded=True)) as ex, pytest.raises(InvalidArgument):
        PoissonLoad(requests=1).run(ex, 1.0, {})
