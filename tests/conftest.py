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
