"""Shape buckets (issue 36 item 3, "Must show"): on tiny-buckets (decode graphs at batch
1 .. 64), each step runs on the cheapest graph that covers its rows, by the step-cost
evidence, on the simulated device and the native emulator, in step and threaded mode.

- Every row of every bucket equals the reference model (the golden prompts at 1 .. 16
  streams at a time: every bucket up to b16 carries steps).
- A stream that moves between graphs mid-generation (rows joining and leaving) gives the
  tokens it gives alone.
- Missing or failing evidence keeps one graph (the widest) with the reason in
  ``health().notes``; the costs' own evidence names a graph it did not measure.
- A graph failing its warm-up golden is taken out alone (named, with the reason); the
  others serve.
"""

from __future__ import annotations

from typing import Any

import pytest

from calfsm.drivers.base import Capabilities
from calfsm.errors import CalrtCode
from calfsm.generate.sampling import SamplingParams
from calfsm.tools.direct import golden_prompts
from tests.helpers.buckets import BUCKETS, graphs_of, make_bucketed, make_driver
from tests.helpers.executor import drive
from tests.helpers.streams import assert_freed, direct_runner, reference_fixtures, run_streams

PROMPTS = golden_prompts()[:40]
N_TOKENS = 12
GREEDY = SamplingParams(max_tokens=N_TOKENS)
WIDEST = "tiny_bk_decode_b64"

pytestmark = pytest.mark.timeout(180)


golden, device = reference_fixtures(PROMPTS, N_TOKENS)


def test_every_row_of_every_bucket_equals_the_reference(mode, golden, tmp_path, device):
    with make_bucketed(device, mode, tmp_path) as ex:
        assert ex.health().notes == ()
        at = 0
        for lanes in (1, 2, 3, 4, 6, 8, 16):        # b1, b2, b4, b4, b8, b8, b16
            batch = PROMPTS[at:at + lanes]
            got = run_streams(ex, batch, GREEDY, lanes=lanes)
            for i in range(len(batch)):
                assert list(got[i][0].tokens) == golden[at + i], f"prompt {at + i}"
            at += lanes
        assert_freed(ex)
        log = graphs_of(ex)
        assert WIDEST not in log.steps, log.steps      # a 64-row graph for <= 16 rows
        if mode == "step":
            for b in (1, 2, 4, 8, 16):
                assert log.steps[f"tiny_bk_decode_b{b}"] > 0, log.steps
        else:
            assert len(log.steps) >= 2, log.steps


def test_a_stream_moving_between_graphs_gives_its_tokens_alone(mode, tmp_path, device):
    runner = direct_runner()
    long_prompt, others = PROMPTS[1], [(PROMPTS[i], n) for i, n in
                                       ((5, 6), (9, 20), (12, 3), (20, 14), (30, 9))]
    with make_bucketed(device, mode, tmp_path) as ex:
        alone = ex.generate(long_prompt, SamplingParams(max_tokens=80))
        drive(ex, lambda: alone.sequence.position >= len(long_prompt) + 10)
        first = [ex.generate(p, SamplingParams(max_tokens=n)) for p, n in others[:3]]
        drive(ex, lambda: all(s.done() for s in first[:1]) or alone.done())
        second = [ex.generate(p, SamplingParams(max_tokens=n)) for p, n in others[3:]]
        drive(ex, lambda: all(s.done() for s in [alone, *first, *second]), timeout=60)
        assert list(alone.result(0).tokens) == runner.generate(0, long_prompt, 80)
        for s, (p, n) in zip(first + second, others, strict=True):
            assert list(s.result(0).tokens) == runner.generate(0, p, n)
        assert_freed(ex)
        log = graphs_of(ex)
        assert "tiny_bk_decode_b1" in log.steps, log.steps
        assert len(log.steps) >= 2 and WIDEST not in log.steps, log.steps


def test_rows_go_alone_when_every_covering_graph_is_busy(golden, tmp_path, device):
    """Every shape bucket's slots held: a lone step runs where it was prepared (the
    narrowest graph), and the rows of a batch go back to the queue and run alone,
    each right, instead of waiting for a slot."""
    from calfsm.manifest import TaskKind
    with make_bucketed(device, "step", tmp_path) as ex:
        pool = ex.epoch.pool
        prepared = {s.contract.max_batch for s in pool.slots
                    if s.kind is TaskKind.DECODE and s.graph is None}
        assert prepared == {1}                      # jobs are prepared in b1 slots
        held = []
        for name in ex.epoch.buckets.names:
            while True:
                try:
                    held.append(pool.acquire(TaskKind.DECODE, graph=name))
                except Exception:
                    break
        got = run_streams(ex, PROMPTS[:4], GREEDY, lanes=4)
        assert [list(got[i][0].tokens) for i in range(4)] == golden[:4]
        assert set(graphs_of(ex).steps) == {"tiny_bk_decode_b1"}, graphs_of(ex).steps
        for lease in held:
            pool.release(lease)
        got = run_streams(ex, PROMPTS[4:8], GREEDY, lanes=4)
        assert [list(got[i][0].tokens) for i in range(4)] == golden[4:8]
        assert graphs_of(ex).steps["tiny_bk_decode_b4"] > 0
        assert_freed(ex)


@pytest.mark.parametrize(("evidence", "why"), [
    ({"evidence": False}, "graph_step_costs is unknown"),
    ({"continuity": False}, "graph_kv_continuity is failed"),
    ({"costs": False}, "graph_step_costs is failed"),
    ({"skip": ("tiny_bk_decode_b4",)}, "measured no step of tiny_bk_decode_b4"),
])
def test_missing_or_failing_evidence_keeps_one_graph_with_the_reason(tmp_path, device,
                                                                     golden, evidence, why):
    with make_bucketed(device, "step", tmp_path, **evidence) as ex:
        notes = ex.health().notes
        assert len(notes) == 1 and why in notes[0], notes
        assert notes[0].startswith("shape buckets (7 decode graphs, b1/b2/b4/b8/b16/b32/b64"
                                   f"): running one, {WIDEST}: ")
        got = run_streams(ex, PROMPTS[:3], GREEDY, lanes=3)
        assert [list(got[i][0].tokens) for i in range(3)] == golden[:3]
        assert set(graphs_of(ex).steps) == {WIDEST}


class FailingGraph:
    """Proxy to a driver whose ``infer`` of one graph (by exact name) is refused: that
    graph cannot pass its golden, every other can."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name
        self._bad: Any = None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    def capabilities(self) -> Capabilities:
        return self._inner.capabilities()

    def model(self, exact_name: str) -> tuple[int, Any]:
        rc, handle = self._inner.model(exact_name)
        if exact_name == self._name:
            self._bad = handle
        return rc, handle

    def infer(self, model: Any, *args: Any, **kw: Any) -> int:
        if self._bad is not None and model is self._bad:
            return int(CalrtCode.UNEXPECTED)
        return self._inner.infer(model, *args, **kw)

    def infer_fixed(self, model: Any, *args: Any, **kw: Any) -> int:
        if self._bad is not None and model is self._bad:
            return int(CalrtCode.UNEXPECTED)
        return self._inner.infer_fixed(model, *args, **kw)

    def __enter__(self) -> FailingGraph:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()


def test_a_graph_failing_its_golden_is_taken_out_alone(mode, golden, tmp_path, device):
    drv = FailingGraph(make_driver(device, mode), "tiny_bk_decode_b2")
    with make_bucketed(device, mode, tmp_path, driver=drv) as ex:
        assert ex.health().ready
        notes = ex.health().notes
        assert len(notes) == 1, notes
        assert notes[0].startswith("shape bucket tiny_bk_decode_b2 taken out: warm-up "
                                   "golden failed"), notes
        for lanes in (1, 2):
            got = run_streams(ex, PROMPTS[:lanes], GREEDY, lanes=lanes)
            assert [list(got[i][0].tokens) for i in range(lanes)] == golden[:lanes]
        log = graphs_of(ex)
        assert "tiny_bk_decode_b2" not in log.steps, log.steps
        if mode == "step":
            assert log.steps["tiny_bk_decode_b1"] > 0 and log.steps["tiny_bk_decode_b4"] > 0


def test_a_manifest_without_buckets_runs_as_before(tmp_path):
    """Batch-1 and batch-8 manifests: no note, no bucket slot, every step on the graph."""
    from calfsm.drivers.sim import SimDriver
    from calfsm.executor import DeviceExecutor, ExecutorConfig
    from calfsm.manifest import builtin_manifest
    for name in ("tiny", "tiny-b8"):
        m = builtin_manifest(name)
        with DeviceExecutor(SimDriver(m), m, ExecutorConfig(threaded=False,
                                                            evidence_dir=str(tmp_path))) as ex:
            assert not any("shape bucket" in n for n in ex.health().notes)
            assert ex.epoch.buckets is None
            assert all(s.graph is None for s in ex.epoch.pool.slots)
    assert BUCKETS.bucketed
