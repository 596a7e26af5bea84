"""Test-wide settings: the hypothesis ``ci`` profile loads when ``CI`` is set (as in CI):
derandomized, so a CI run is repeatable, with no example database and no deadline (a
2-core VM shared with other work must not turn slow examples into failures)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from calfsm import lograte
from tests.executor_helpers import MODES

settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _fresh_log_limits() -> None:
    """Each test sees its first warnings: the process-wide log rate limits start over."""
    lograte.reset()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """Each executor-level test runs in step mode and in threaded mode."""
    return request.param


@pytest.fixture(autouse=True)
def _own_evidence_dir(tmp_path_factory: pytest.TempPathFactory,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees an empty evidence directory of its own through
    ``$CALFSM_EVIDENCE_DIR`` (the default rule would read ``./evidence`` of wherever the
    suite runs): a runner someone ran in the checkout cannot turn two in flight on in a
    test. Tests of the default rule unset it."""
    monkeypatch.setenv("CALFSM_EVIDENCE_DIR", str(tmp_path_factory.mktemp("evidence")))
