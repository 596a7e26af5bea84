"""The module paths calfsm had before its folders drew the layers still import, as the
very module that lives at the new path (calfsm/_moved.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from calfsm._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_path(old: str) -> None:
    if MOVED[old] in ("telemetry.metrics", "tools.soak_plots"):
        pytest.importorskip("prometheus_client" if old == "metrics" else "matplotlib")
    was = importlib.import_module(f"calfsm.{old}")
    now = importlib.import_module(f"calfsm.{MOVED[old]}")
    assert was is now
    assert now.__spec__.name == f"calfsm.{MOVED[old]}"      # its own spec, not the alias's


def test_the_readme_s_old_import_works_in_a_fresh_process() -> None:
    code = ("from calfsm.sampling import SamplingParams\n"
            "from calfsm import SamplingParams as S\n"
            "assert SamplingParams is S\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_path_that_never_was_is_still_an_import_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("calfsm.no_such_module")


def test_the_old_runtime_module_s_names_are_the_runtime_package_s() -> None:
    """``calfsm.runtime`` was a module and is now the folder of the runtimes: what the
    module offered, the package offers."""
    from calfsm.runtime import StepRuntime, Steps, ThreadRuntime
    from calfsm.runtime.drive import StepRuntime as S
    from calfsm.runtime.drive import Steps as T
    from calfsm.runtime.drive import ThreadRuntime as R
    assert (StepRuntime, Steps, ThreadRuntime) == (S, T, R)
