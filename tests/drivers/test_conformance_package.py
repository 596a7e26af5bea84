"""The conformance suite ships in calfsm.testing.conformance: it runs with one command from
anywhere, and calfsm's own suite runs every one of its tests under tests/drivers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: tests/drivers modules that are calfsm's own, not the shipped suite's
OWN = ("test_sim.py", "test_registry.py", "test_faultplan.py", "test_conformance_package.py")


def _pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args], cwd=cwd, capture_output=True, text=True)


def _ids(*args: str) -> set[str]:
    out = _pytest("--collect-only", *args, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return {line.split("/")[-1] for line in out.stdout.splitlines() if "::" in line}


def test_one_command_runs_it_from_any_directory(tmp_path) -> None:
    out = _pytest("--pyargs", "calfsm.testing.conformance", "-k",
                  "test_unconfigured or test_every_protocol_call", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout              # test_unconfigured x (calrt, sim) + one


def test_tests_drivers_runs_every_test_of_the_shipped_suite() -> None:
    shipped = _ids("--pyargs", "calfsm.testing.conformance")
    here = {i for i in _ids("tests/drivers") if not i.startswith(OWN)}
    assert len(shipped) > 300
    assert here == shipped
