"""The step-cost runner (examples/vendor/step_costs.py) and the executor's reading of its
evidence (calfsm.plan.buckets.plan_buckets), issue 36 items 2 and 3.

- On the simulated device and the native emulator with ``tiny-buckets`` it measures every
  decode graph (a step against its rows, against the context, prefill per token) and
  proves both capabilities; on a static device (``shape_cost="graph"``) a graph's step
  costs its whole batch, on a dynamic one (``"rows"``) the rows, and the context slope is
  what the device adds per token.
- A device whose graphs do not continue each other's KV bit-exact fails
  ``graph_kv_continuity`` (and the plan keeps one graph, saying so).
- ``plan_buckets``: on proven evidence the cheapest covering graph per step; no note on a
  manifest without buckets; one graph with the reason when the evidence is missing, for
  another calbin, malformed, or did not measure a graph.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.plan.buckets import STEP_COSTS, plan_buckets
from calfsm.plan.capabilities import Evidence
from tests.helpers.vendor import runner

BUCKETS = builtin_manifest("tiny-buckets")
STATIC = "virtual:decode_ms=10,batch_row_share=0.05"
DYNAMIC = "virtual:decode_ms=10,batch_row_share=0.05,shape_cost=rows,context_token_ns=100"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def mod() -> ModuleType:
    return runner("step_costs")


def run(mod: ModuleType, out: Path, *extra: str, driver: str = "sim", given: Any = None
        ) -> tuple[int, Evidence]:
    rc = mod.main(["--manifest", "tiny-buckets", "--driver", driver, "--out", str(out),
                   "--repeats", "1", "--max-context", "512", *extra], driver=given)
    (path,) = out.glob("step_costs-*-0.7.6.json")
    return rc, Evidence.load(path)


def costs(ev: Evidence) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for g in ev.observations[STEP_COSTS]["graphs"]}


@pytest.mark.parametrize("driver", ["sim", "calrt"])
def test_a_static_device_proves_both_and_prices_a_graph_by_its_batch(mod, tmp_path,
                                                                       driver):
    rc, ev = run(mod, tmp_path, "--latency", STATIC, driver=driver)
    assert rc == 0 and ev.complete and ev.passed, ev.verdicts
    c = costs(ev)
    for b in (1, 2, 4, 8, 16, 32, 64):
        g = c[f"tiny_bk_decode_b{b}"]
        full = 0.010 * (1 + 0.05 * (b - 1))
        assert set(g["decode_s"]) == {str(r) for r in (1, 2, 4, 8, 16, 32, 64) if r <= b}
        for s in g["decode_s"].values():            # padded rows cost as much
            assert s == pytest.approx(full, rel=0.01)
        assert g["context_s_per_token"] == pytest.approx(0.0, abs=1e-9)
    assert c["tiny_bk_prefill_ids"]["prefill_s_per_token"] == pytest.approx(2e-4, rel=0.01)
    assert ev.observations["kv_continuity"]["differ"] == 0
    plan = plan_buckets(BUCKETS, _driver(driver), evidence_dir=tmp_path)
    assert plan.note is None and plan.buckets is not None, plan.note
    pick = {rows: plan.buckets.choose(rows, 100).max_batch for rows in (1, 2, 3, 5, 9, 40)}
    assert pick == {1: 1, 2: 2, 3: 4, 5: 8, 9: 16, 40: 64}


@pytest.mark.parametrize("driver", ["sim", "calrt"])
def test_a_dynamic_device_prices_the_rows_and_the_context(mod, tmp_path, driver):
    rc, ev = run(mod, tmp_path, "--latency", DYNAMIC, driver=driver)
    assert rc == 0 and ev.passed, ev.verdicts
    g = costs(ev)["tiny_bk_decode_b64"]
    assert g["decode_s"]["1"] < g["decode_s"]["64"] / 3
    assert g["context_s_per_token"] == pytest.approx(100e-9, rel=0.05)


class SeparateKv(SimDriver):
    """A device whose b2 graph reads a sequence's KV as if another graph never wrote
    it: its logits come out one bit off (what a device without shared KV would do)."""

    def wait(self, out: Any, timeout_s: float) -> int:
        rc = super().wait(out, timeout_s)
        if rc == 0 and getattr(out.model, "name", "") == "tiny_bk_decode_b2":
            for arr in out.maps.values():
                arr.reshape(-1)[:1] ^= np.uint16(1)
        return rc


def test_graphs_that_do_not_continue_each_others_kv_fail_continuity(mod, tmp_path):
    drv = SeparateKv(BUCKETS, latency=LatencyModel.virtual_default())
    rc, ev = run(mod, tmp_path, given=drv)
    assert rc == 0
    assert not ev.verdicts["graph_kv_continuity"].holds
    assert "differ from staying on one graph" in ev.verdicts["graph_kv_continuity"].reason
    plan = plan_buckets(BUCKETS, SimDriver(BUCKETS), evidence_dir=tmp_path)
    assert plan.buckets is None and "graph_kv_continuity is failed" in plan.note


def _driver(name: str) -> Any:
    return SimDriver(BUCKETS) if name == "sim" else CalrtDriver.virtual(
        manifest_or_calbin=BUCKETS)


def test_no_note_without_buckets_and_one_graph_without_evidence(tmp_path):
    for name in ("tiny", "tiny-b8", "qwen3-b1"):
        m = builtin_manifest(name)
        assert plan_buckets(m, SimDriver(m), evidence_dir=tmp_path).note is None
    plan = plan_buckets(BUCKETS, SimDriver(BUCKETS), evidence_dir=tmp_path)
    assert plan.buckets is None
    assert plan.note.startswith("shape buckets (7 decode graphs, b1/b2/b4/b8/b16/b32/b64): "
                                "running one, tiny_bk_decode_b64: graph_step_costs is "
                                "unknown: no evidence")
    assert "run examples/vendor/step_costs.py" in plan.note


def test_evidence_for_another_calbin_or_malformed_proves_nothing(mod, tmp_path):
    rc, ev = run(mod, tmp_path)
    assert rc == 0 and ev.passed
    (path,) = tmp_path.glob("step_costs-*.json")
    other = builtin_manifest("qwen3-buckets")
    plan = plan_buckets(other, SimDriver(other), evidence_dir=tmp_path)
    assert plan.buckets is None and "stale" in plan.note and "is for calbin" in plan.note
    data = json.loads(path.read_text())
    data["observations"][STEP_COSTS]["graphs"][3]["decode_s"] = {"1": "fast"}
    path.write_text(json.dumps(data))
    plan = plan_buckets(BUCKETS, SimDriver(BUCKETS), evidence_dir=tmp_path)
    assert plan.buckets is None and "malformed" in plan.note
    data["observations"][STEP_COSTS]["graphs"] = [
        g for g in data["observations"][STEP_COSTS]["graphs"]
        if g["name"] != "tiny_bk_decode_b8"]
    path.write_text(json.dumps(data))
    plan = plan_buckets(BUCKETS, SimDriver(BUCKETS), evidence_dir=tmp_path)
    assert plan.buckets is None and "measured no step of tiny_bk_decode_b8" in plan.note


def test_the_widest_graph_is_the_manifests_graph_of_its_kind():
    assert BUCKETS.submodel(TaskKind.DECODE).exact_name == "tiny_bk_decode_b64"


def test_calfsm_capabilities_shows_what_the_executor_switches_between(mod, tmp_path, capsys):
    from calfsm.tools import cli
    base = ["capabilities", "--evidence-dir", str(tmp_path), "--manifest", "tiny-buckets",
            "--require", "none", "--json"]
    assert cli.main(base) == 0
    shown = json.loads(capsys.readouterr().out)["shape_buckets"]
    assert not shown["switching"] and "running one, tiny_bk_decode_b64" in shown["why"]
    run(mod, tmp_path)
    capsys.readouterr()
    assert cli.main(base) == 0
    shown = json.loads(capsys.readouterr().out)["shape_buckets"]
    assert shown["switching"] and len(shown["graphs"]) == 7
    assert "proves graph_step_costs, graph_kv_continuity" in shown["why"]
    assert cli.main([*base[:-3], "--manifest", "tiny", "--require", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shape_buckets"] is None


def test_each_calbins_costs_keep_a_file_of_their_own(mod, tmp_path):
    """Costs are the calbin's: a run on another calbin of the same device does not
    replace them (the file names the manifest)."""
    run(mod, tmp_path)
    assert mod.main(["--manifest", "tiny", "--out", str(tmp_path), "--repeats", "1",
                     "--max-context", "64"]) == 0
    names = sorted(p.name for p in tmp_path.glob("step_costs-*.json"))
    assert names == ["step_costs-sim-tiny-0.7.6.json", "step_costs-sim-tiny-buckets-0.7.6.json"]
    plan = plan_buckets(BUCKETS, SimDriver(BUCKETS), evidence_dir=tmp_path)
    assert plan.buckets is not None, plan.note
