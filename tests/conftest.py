"""Test-wide settings: the hypothesis ``ci`` profile loads when ``CI`` is set (as in CI):
derandomized, so a CI run is repeatable, with no example database and no deadline (a
2-core VM shared with other work must not turn slow examples into failures)."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
