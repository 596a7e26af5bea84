"""One evidence directory (issue 20): the runners write, and ``calfsm capabilities``,
``calfsm run`` and the executor read, the same place by one rule — an explicit
directory, else ``$CALFSM_EVIDENCE_DIR``, else ``./evidence`` of the working directory."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from calfsm.drivers.sim import SimDriver
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.manifest import builtin_manifest
from calfsm.plan.capabilities import DEFAULT_DIR, ENV_DIR, EvidenceStore, evidence_dir
from calfsm.tools import cli

VENDOR = Path(__file__).resolve().parents[2] / "examples" / "vendor"
SMALL = ("run", "--manifest", "tiny", "--prompts", "2", "--sequences", "1", "--tokens",
         "2", "--max-prompt", "4", "--quiet")


def parallel_mode() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vendor_parallel_mode",
                                                  VENDOR / "parallel_mode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory and no ``$CALFSM_EVIDENCE_DIR``: the default rule."""
    monkeypatch.delenv(ENV_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_rule_explicit_then_environment_then_default(no_env: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    assert evidence_dir() == no_env / DEFAULT_DIR
    assert evidence_dir("") == no_env / DEFAULT_DIR      # an empty option is no option
    monkeypatch.setenv(ENV_DIR, "")
    assert evidence_dir() == no_env / DEFAULT_DIR
    monkeypatch.setenv(ENV_DIR, str(no_env / "env"))
    assert evidence_dir() == no_env / "env"
    assert evidence_dir("given") == no_env / "given"     # relative: to the cwd, now
    monkeypatch.chdir(no_env.parent)
    assert evidence_dir(no_env / "x") == no_env / "x"
    assert EvidenceStore().directory == no_env / "env"
    assert ExecutorConfig().evidence_dir is None         # None: the rule


def _run_two(capsys: pytest.CaptureFixture, *extra: str) -> tuple[str, str]:
    assert cli.main([*SMALL, "--max-inflight", "2", *extra]) == 0
    captured = capsys.readouterr()
    m = re.search(r"jobs in flight: asked / running\s*│\s*(\d) / (\d)", captured.out)
    assert m, captured.out
    return m[2], captured.err


def test_what_the_runner_writes_by_default_every_reader_reads(
        no_env: Path, capsys: pytest.CaptureFixture) -> None:
    """Before issue 20 the runner wrote ./evidence, which ``capabilities`` read, while
    the executor (and so ``calfsm run``) read only the environment variable: proven,
    and still one in flight."""
    tiny = builtin_manifest("tiny")

    def inflight() -> int:
        with DeviceExecutor(SimDriver(tiny), tiny,
                            ExecutorConfig(threaded=False, max_inflight=2)) as ex:
            return ex.health().max_inflight

    assert inflight() == 1
    assert parallel_mode().main(["--manifest", "tiny"]) == 0     # no --out: the rule
    capsys.readouterr()
    assert list((no_env / DEFAULT_DIR).glob("parallel_mode-sim-*.json"))
    assert cli.main(["capabilities", "--manifest", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evidence_dir"] == str(no_env / DEFAULT_DIR)
    assert inflight() == 2
    running, err = _run_two(capsys)
    assert running == "2" and "note:" not in err


def test_run_takes_evidence_dir_and_the_environment(no_env: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    proof = no_env / "proof"
    assert parallel_mode().main(["--manifest", "tiny", "--out", str(proof)]) == 0
    capsys.readouterr()
    running, err = _run_two(capsys)                 # ./evidence is empty
    assert running == "1" and f"no evidence for sim runtime 0.7.6 in {no_env}" in err
    assert _run_two(capsys, "--evidence-dir", str(proof))[0] == "2"
    monkeypatch.setenv(ENV_DIR, str(proof))
    assert _run_two(capsys)[0] == "2"
    # the option beats the environment
    assert _run_two(capsys, "--evidence-dir", str(no_env / "empty"))[0] == "1"
