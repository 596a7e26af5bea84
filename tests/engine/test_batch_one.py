"""A batch calbin (``tiny-b8``) run one row per job: what the executor does before
batching is proven, and what it must keep doing when it is not (issue 22, "the batch-1
manifests' tests and goldens unchanged"; docs/driver-protocol.md, Batches).

- Greedy streams on the batch-8 graphs, one row per job, give the batch-1 goldens, in
  step and threaded mode, and leave everything freed.
- Each slot of a batch graph says once that its jobs carry one row (``set_batch_rows``).
- A row that ends ``DONE_CCU_EXCEPTION`` while its job ends ``DONE_OK`` fails that job as
  a device status fault does (FI08), and a stream resumes with the fault-free tokens.
- A driver without the batch calls is refused a batch calbin with the reason.
"""

from __future__ import annotations

import pytest

from calfsm.drivers.base import Capabilities, ResetKind
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.errors import ErrorCategory, Incompatible, Unavailable
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason
from calfsm.manifest import builtin_manifest
from tests.helpers.executor import calls, drive, make_executor
from tests.helpers.streams import GREEDY, PROMPTS, assert_freed, golden_tokens, run_streams, settle

B8 = builtin_manifest("tiny-b8")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def golden() -> list[list[int]]:
    return golden_tokens(PROMPTS, GREEDY.max_tokens)


def test_streams_on_a_batch_graph_one_row_per_job_equal_the_goldens(mode, golden):
    with make_executor(mode, manifest=B8) as ex:
        got = run_streams(ex, PROMPTS, GREEDY, lanes=4)
        for i, prompt in enumerate(PROMPTS):
            assert list(got[i][0].tokens) == golden[i], f"prompt {i} (len {len(prompt)})"
        assert_freed(ex)
        slots = ex.epoch.pool.stats().total
        rows = calls(ex.driver, "set_batch_rows")
        assert len(rows) == slots and {c["rows"] for c in rows} == {1}
        assert not any(c["name"] == "input_ids" for c in calls(ex.driver, "slice_tensor"))


def test_a_failed_row_fails_its_job_as_a_device_status_fault(mode, golden):
    """Row 0 ends DONE_CCU_EXCEPTION in a DONE_OK job: Unavailable of category device,
    then the stream's resume replays to the fault-free tokens."""
    plan = FaultPlan((FaultRule("infer", "row_ccu_exception", nth=6),))
    with make_executor(mode, manifest=B8, faults=plan) as ex:
        s = ex.generate(PROMPTS[5], SamplingParams(max_tokens=12))
        r = settle(ex, s)
        assert ex.driver.faults_fired() == (1,)
        assert r.finish_reason == FinishReason.LENGTH and r.error is None
        assert list(r.tokens) == golden[5][:12]
        errors = ex.stats().errors_by_category
        assert errors.get(ErrorCategory.DEVICE.value, 0) >= 1, errors


def test_a_failed_row_without_resume_is_a_retryable_device_error(mode):
    plan = FaultPlan((FaultRule("infer", "row_ccu_exception", nth=3),))
    with make_executor(mode, manifest=B8, faults=plan) as ex:
        r = settle(ex, ex.generate(PROMPTS[5], SamplingParams(max_tokens=8), resume=False))
        assert r.finish_reason == FinishReason.ERROR
        assert isinstance(r.error, Unavailable) and r.error.retryable, r.error
        assert "DONE_CCU_EXCEPTION" in str(r.error)
        drive(ex, lambda: ex.lifecycle_state == "Ready")


def test_a_driver_without_the_batch_calls_is_refused_a_batch_calbin():
    caps = Capabilities(resets=frozenset(ResetKind))
    drv = SimDriver(B8, capabilities=caps)
    with pytest.raises(Incompatible, match=r"batch graphs \(max_batch 8\) need a driver "
                                           r"with the batch calls; driver 'sim' has none"):
        DeviceExecutor(drv, B8, ExecutorConfig(threaded=False))
