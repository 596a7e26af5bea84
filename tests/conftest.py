"""Test-wide settings. The hypothesis profile is the same whether ``CI`` is set or not,
so the README's command and ``.ci/run`` run the same suite:

- ``repeatable`` (the default): derandomized, so every run tries the same examples and
  a failure replays; no example database (nothing a run leaves behind changes the next
  one); no deadline and no ``too_slow`` health check (wall-clock limits per example or
  per draw fail slow examples on a loaded machine, which says nothing about the code).
- ``explore`` (opt-in: ``HYPOTHESIS_PROFILE=explore``): a random search, new examples
  each run, failures kept in ``.hypothesis/`` and replayed first next time; no wall-clock
  limits either. What it finds becomes a deterministic regression test.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from calfsm.util import lograte
from tests.helpers.executor import MODES

# Both are built on hypothesis's own "default" profile, not on the current one:
# hypothesis itself loads its "ci" profile when it sees CI (set to anything) or another
# CI's variable, which would otherwise leak into what is not set here.
_BASE = settings(settings.get_profile("default"), deadline=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow])
#: the profiles tests/conftest.py registers, by name
PROFILES = {
    "repeatable": settings(_BASE, derandomize=True, database=None),
    "explore": settings(_BASE, derandomize=False),
}
DEFAULT_PROFILE = "repeatable"

for _name, _profile in PROFILES.items():
    settings.register_profile(_name, _profile)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or DEFAULT_PROFILE)


#: the files that run longest (``python -m pytest -q --durations=60`` on 2 cores, most
#: first): collected first, so that under pytest-xdist (``--dist loadfile
#: --no-loadscope-reorder``) they start at once on their workers while the many short
#: files fill the others, instead of one of them starting last and running alone
LONG_FIRST = (
    "tests/generate/test_streams_stateful.py",       # one hypothesis machine, ~2 min
    "tests/tools/test_soak_cli.py",                  # the 60 s soak leak test and more
    "tests/test_bench_smoke.py",
    "tests/engine/test_every_call_faults.py",
    "tests/serve/test_ray_serve.py",                 # a local Ray cluster
    "tests/api/test_executor.py",
    "tests/drivers/test_conformance_package.py",     # pytest in subprocesses
    "tests/engine/test_batching.py",
    "tests/serve/test_serve_deadlines.py",
    "tests/native/test_sanitizers.py",               # two sanitizer builds
    "tests/tools/test_cli.py",
    "tests/native/test_conformance_instant.py",
    "tests/serve/test_serve_probes.py",
    "tests/tools/test_soak.py",
    "tests/generate/test_constraint.py",             # ~50 s of constrained outputs
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of :data:`LONG_FIRST` first, in its order; the rest as collected."""
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(autouse=True)
def _fresh_log_limits() -> None:
    """Each test sees its first warnings: the process-wide log rate limits start over."""
    lograte.reset()


@pytest.fixture(autouse=True)
def _log_levels_restored() -> Iterator[None]:
    """Each test starts with the log levels it found: ``calfsm soak`` run in-process sets
    the ``calfsm`` logger to CRITICAL (and ``calfsm run`` the root to ERROR) for the rest
    of the process, which silenced the warnings later tests look for in ``caplog``
    whenever a soak test ran before them in the same process (pytest-xdist's order)."""
    root, ours = logging.getLogger(), logging.getLogger("calfsm")
    levels = root.level, ours.level
    yield
    root.setLevel(levels[0])
    ours.setLevel(levels[1])


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """Exceptions that escaped any thread during the test (``threading.excepthook``)."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


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


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> object:
    """The realistic tokenizer of the qwen3 manifests (calfsm.tools.make_tokenizer: a
    byte-level BPE of 151,936 ids with Qwen3's added tokens at their ids), saved as
    Hugging Face saves one: built once per machine into the user's cache (~16 s on 2 idle
    cores), then reused. Skips without the ``hf`` extra."""
    pytest.importorskip("tokenizers")
    from calfsm.tools.make_tokenizer import cached_tokenizer
    return cached_tokenizer()


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir: object) -> object:
    """The realistic tokenizer as the executor's (an HFTokenizer, with its chat
    template); for wherever the qwen3 manifests meet text."""
    pytest.importorskip("jinja2")
    from calfsm.generate.tokenizer import HFTokenizer
    return HFTokenizer.from_dir(qwen_tokenizer_dir)  # type: ignore[arg-type]
