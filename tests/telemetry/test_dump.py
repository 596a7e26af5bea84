"""The dump sink (spec S12, issue 15 part 5): off by default, no default directory,
selective (a job id or a failure category), bounded in files and bytes (writing stops;
nothing is deleted or overwritten), and file names from job id and generation only.
Step mode on the virtual clock; faults from fault plans."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import ErrorCategory, InvalidArgument
from calfsm.executor import ExecutorConfig
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from calfsm.telemetry.dump import DumpConfig, DumpSink, dump_name
from tests.helpers.executor import make_executor

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7, 8]
NAME = re.compile(r"job-\d+-gen-\d+\.npz")


def run_jobs(ex, seqs, *, cancel=()) -> list:
    handles = [ex.enqueue_nowait(Request.prefill(s, PROMPT)) for s in seqs]
    for i in cancel:
        handles[i].cancel()
    StepScheduler(ex).run_until(lambda: all(h.done() for h in handles) and ex.idle())
    return handles


def load(path: Path) -> tuple[dict, dict]:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(arrays.pop("meta").item()), arrays


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# ---- off by default, and no default directory ---------------------------------------------

def test_off_by_default_writes_nothing_anywhere(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert ExecutorConfig().dump is None
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=3))
    with make_executor("step", faults=plan,
                       recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        assert ex.dump_sink is None and len(ex.observers) == 0
        (h,) = run_jobs(ex, [3])
        assert h.exception(0) is not None
    assert listing(home) == [] and listing(tmp_path) == ["home"]


@pytest.mark.parametrize("directory", [None, "", "   ", "~/dumps", "~"])
def test_enabling_without_a_directory_is_a_config_error(directory):
    with pytest.raises(InvalidArgument, match="directory"):
        DumpConfig(directory=directory, categories={"device"})


def test_no_default_directory():
    with pytest.raises(InvalidArgument, match="no default dump directory"):
        DumpConfig(categories={"device"})


@pytest.mark.parametrize("kw", [
    {"categories": {"devices"}}, {"categories": "device"}, {"job_ids": {0}},
    {"job_ids": {True}}, {"max_files": 0}, {"max_bytes": -1}, {"max_files": 1.5},
    # TypeError before issue 20: not a collection, or a member that cannot be hashed
    {"job_ids": None}, {"job_ids": 5}, {"job_ids": [[1]]}, {"job_ids": "12"},
    {"categories": None}, {"categories": 5}, {"categories": [["device"]]},
])
def test_bad_dump_config_values_are_refused(tmp_path, kw):
    (field,) = kw
    with pytest.raises(InvalidArgument, match=f"DumpConfig.{field}"):
        DumpConfig(directory=tmp_path, **kw)


def test_watch_refuses_what_is_no_job_id(tmp_path):
    sink = DumpSink(DumpConfig(directory=tmp_path))
    for bad in ([1], None, 0, "7"):
        with pytest.raises(InvalidArgument, match=r"DumpConfig\.job_ids"):
            sink.watch(bad)
    sink.watch(7)


def test_bad_values_in_the_executor_config_are_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="DumpConfig"):
        ExecutorConfig(dump=str(tmp_path))
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(InvalidArgument, match="not usable"):
        make_executor("step", dump=DumpConfig(directory=afile / "sub", job_ids={1}))


# ---- what is written -----------------------------------------------------------------------

def test_a_failure_category_dumps_the_failed_job_with_its_raw_output(tmp_path):
    """A NaN in the logits (FI10, category unknown): the job's inputs, its error and the
    BF16 output bits as the device left them; the jobs that succeeded are not dumped."""
    plan = FaultPlan.of(FaultRule("infer", "nan", seq_id=3, index=17))
    cfg = DumpConfig(directory=tmp_path / "dumps", categories={ErrorCategory.UNKNOWN})
    with make_executor("step", faults=plan, dump=cfg,
                       recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        ok1, bad, = run_jobs(ex, [1, 3])
        assert ok1.exception(0) is None and bad.exception(0) is not None
        StepScheduler(ex).run_until(lambda: ex.lifecycle_state == "Ready")
        ok2, = run_jobs(ex, [2])
        assert ok2.exception(0) is None
        sink = ex.dump_sink
    name = dump_name(bad.job_id, 1)
    assert listing(tmp_path / "dumps") == [name]
    meta, arrays = load(tmp_path / "dumps" / name)
    assert meta["job_id"] == bad.job_id and meta["generation"] == 1 and meta["seq_id"] == 3
    assert meta["outcome"] == "quarantined" and meta["kind"] == "prefill_ids"
    assert meta["error"]["category"] == "unknown" and "non-finite" in meta["error"]["message"]
    assert meta["timings"]["submitted"] > 0
    assert list(arrays["tokens"]) == PROMPT and list(arrays["positions"]) == [0, 1, 2, 3]
    bits = arrays["output_bits"]
    assert bits.dtype == np.uint16
    vocab = ex.epoch.contract(Request.prefill(0, PROMPT).kind).vocab
    assert bits[(len(PROMPT) - 1) * vocab + 17] == 0x7FC0      # the injected BF16 NaN
    assert "logits" not in arrays
    s = sink.stats()
    assert (s.files, s.written, s.dropped, s.errors) == (1, 1, 0, 0)
    assert s.bytes == (tmp_path / "dumps" / name).stat().st_size


def test_a_job_id_dumps_its_inputs_and_logits(tmp_path):
    cfg = DumpConfig(directory=tmp_path, job_ids={2})
    with make_executor("step", dump=cfg) as ex:
        handles = run_jobs(ex, [1, 2, 3])
        assert [h.job_id for h in handles] == [1, 2, 3]
        logits = handles[1].result(0).logits.copy()
        watched = ex.enqueue_nowait(Request.decode(4, 9, 0))
        ex.dump_sink.watch(watched.job_id)        # chosen while the job runs
        StepScheduler(ex).run_until(watched.done)
    assert listing(tmp_path) == [dump_name(2, 1), dump_name(watched.job_id, 1)]
    meta, arrays = load(tmp_path / dump_name(2, 1))
    assert meta["outcome"] == "succeeded" and meta["error"] is None
    np.testing.assert_array_equal(arrays["logits"], logits)
    meta, arrays = load(tmp_path / dump_name(watched.job_id, 1))
    assert meta["kind"] == "decode" and list(arrays["tokens"]) == [9]


def test_file_names_come_from_job_id_and_generation_only(tmp_path):
    """A cancelled job is category request: every one of them is dumped here."""
    cfg = DumpConfig(directory=tmp_path, categories={"request"})
    with make_executor("step", dump=cfg) as ex:
        handles = run_jobs(ex, [1, 2, 3], cancel=(0, 2))
    assert listing(tmp_path) == [dump_name(handles[0].job_id, 1),
                                 dump_name(handles[2].job_id, 1)]
    assert all(NAME.fullmatch(n) for n in listing(tmp_path))
    mode = stat.S_IMODE((tmp_path / listing(tmp_path)[0]).stat().st_mode)
    assert mode & 0o077 == 0                      # only the owner may read a dump


# ---- bounds -------------------------------------------------------------------------------

def test_max_files_stops_writing_and_deletes_nothing(tmp_path, caplog):
    cfg = DumpConfig(directory=tmp_path, categories={"request"}, max_files=2)
    with caplog.at_level(logging.WARNING, logger="calfsm.telemetry.dump"), \
            make_executor("step", dump=cfg) as ex:
        handles = run_jobs(ex, [1, 2, 3, 4, 5], cancel=(0, 1, 2, 3, 4))
        s = ex.dump_sink.stats()
    assert listing(tmp_path) == [dump_name(handles[0].job_id, 1),
                                 dump_name(handles[1].job_id, 1)]   # the first two
    assert (s.files, s.written, s.dropped) == (2, 2, 3)
    assert sum("writing stops" in r.message for r in caplog.records) == 1


def test_max_bytes_stops_writing_and_counts_the_files_already_there(tmp_path):
    one = tmp_path / "probe"
    with make_executor("step", dump=DumpConfig(directory=one, job_ids={1})) as ex:
        run_jobs(ex, [1])
    size = (one / dump_name(1, 1)).stat().st_size
    # a dump already in the directory (an earlier process) takes its share of the bytes
    target = tmp_path / "bounded"
    target.mkdir()
    (target / dump_name(99, 7)).write_bytes(b"\0" * size)
    (target / "unrelated.txt").write_bytes(b"\0" * (10 * size))   # not a dump: not counted
    cfg = DumpConfig(directory=target, job_ids={1, 2, 3}, max_bytes=int(2.5 * size))
    with make_executor("step", dump=cfg) as ex:
        run_jobs(ex, [1, 2, 3])
        s = ex.dump_sink.stats()
    assert listing(target) == sorted([dump_name(99, 7), dump_name(1, 1), "unrelated.txt"])
    assert (s.files, s.written, s.dropped) == (2, 1, 2)
    assert s.bytes == 2 * size <= cfg.max_bytes


def test_an_existing_file_is_never_overwritten(tmp_path):
    (tmp_path / dump_name(1, 1)).write_bytes(b"earlier process")
    cfg = DumpConfig(directory=tmp_path, job_ids={1, 2})
    with make_executor("step", dump=cfg) as ex:
        run_jobs(ex, [1, 2])
        s = ex.dump_sink.stats()
    assert (tmp_path / dump_name(1, 1)).read_bytes() == b"earlier process"
    assert listing(tmp_path) == [dump_name(1, 1), dump_name(2, 1)]
    assert (s.written, s.dropped) == (1, 1)


def test_a_sink_can_be_attached_by_hand(tmp_path):
    with make_executor("step") as ex:
        sink = DumpSink(DumpConfig(directory=tmp_path, job_ids={1}))
        ex.add_observer(sink)
        run_jobs(ex, [1, 2])
    assert listing(tmp_path) == [dump_name(1, 1)]
    with pytest.raises(InvalidArgument):
        DumpSink({"directory": str(tmp_path)})
