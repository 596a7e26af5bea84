"""The suite's hypothesis profile (tests/conftest.py) does not depend on ``CI``: the
README's command and ``.ci/run`` (which sets ``CI=true``) run the same examples, with no
deadline and no example database; ``HYPOTHESIS_PROFILE=explore`` opts in to a random
search."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_PROBE = """
import json
import tests.conftest
from hypothesis import settings
d = settings.default
print(json.dumps({"derandomize": d.derandomize, "deadline": d.deadline,
                  "database": d.database is not None,
                  "too_slow_checked": "too_slow" not in str(d.suppress_health_check)}))
"""


def _loaded(**env: str) -> dict:
    """The default settings once tests/conftest.py is imported under ``env``."""
    full = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=full | env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


#: no wall-clock limit, the same examples every run, nothing kept between runs
REPEATABLE = {"derandomize": True, "deadline": None, "database": False,
              "too_slow_checked": False}


@pytest.mark.parametrize("env", [{}, {"CI": "true"}], ids=["no CI", "CI"])
def test_the_profile_is_the_same_with_or_without_ci(env):
    assert _loaded(**env) == REPEATABLE


@pytest.mark.parametrize("env", [{}, {"CI": "true"}], ids=["no CI", "CI"])
def test_explore_searches_randomly_and_keeps_what_it_finds(env):
    assert _loaded(HYPOTHESIS_PROFILE="explore", **env) == {
        "derandomize": False, "deadline": None, "database": True,
        "too_slow_checked": False}
