"""The package exports what the README uses, and nothing it lists is missing."""

from __future__ import annotations

import subprocess
import sys

import calfsm

README_NAMES = {
    "DeviceExecutor", "ExecutorConfig", "Request", "JobHandle", "InferenceResult",
    "Health", "SimDriver", "FaultPlan", "CalrtDriver", "Manifest", "builtin_manifest",
    "TaskKind", "CalfsmError", "InvalidArgument", "Unavailable", "ExecutorClosed",
    "DeadlineExceeded", "Cancelled", "ResourceExhausted", "StepScheduler",
    "SamplingParams", "Stream", "Sequence", "GenerationResult",
}


def test_every_name_the_readme_uses_is_exported() -> None:
    assert set(calfsm.__all__) >= README_NAMES
    for name in calfsm.__all__:
        assert getattr(calfsm, name) is not None, name


def test_from_calfsm_import_star_gives_all() -> None:
    ns: dict = {}
    exec("from calfsm import *", ns)
    assert set(calfsm.__all__) - {"__version__"} <= set(ns)


def test_calrt_driver_is_imported_lazily() -> None:
    code = ("import sys, calfsm; assert 'calfsm.drivers.calrt' not in sys.modules; "
            "from calfsm import CalrtDriver; assert 'calfsm.drivers.calrt' in sys.modules; "
            "print(CalrtDriver.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "CalrtDriver"


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        calfsm.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("calfsm.NoSuchThing did not raise")


def test_the_readme_example_runs() -> None:
    from calfsm import DeviceExecutor, ExecutorConfig, Request, SimDriver, builtin_manifest

    manifest = builtin_manifest("tiny")
    with DeviceExecutor(SimDriver(manifest, seed=0), manifest, ExecutorConfig()) as ex:
        result = ex.enqueue(Request.prefill(seq_id=0, tokens=[1, 2, 3])).result(30)
        nxt = ex.enqueue(Request.decode(0, result.greedy(), position=3)).result(30)
        assert nxt.token_count == 1 and ex.health().ready
