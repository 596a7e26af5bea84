"""Every script of examples/ runs as a user would run it (a subprocess with a timeout)
and prints what it promises."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from calfsm.drivers.sim import SimDriver
from calfsm.manifest import builtin_manifest
from calfsm.plan.capabilities import CAPABILITIES
from calfsm.tools.direct import DirectRunner

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)


def reference(prompt: list[int], n: int) -> list[int]:
    manifest = builtin_manifest("tiny")
    with SimDriver(manifest) as d:
        return DirectRunner(d, manifest).generate(0, prompt, n)


def test_asyncio_server_streams_the_reference_tokens(tmp_path: Path) -> None:
    p = run("asyncio_server.py", "--requests", "3", "--tokens", "6", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert re.search(r"serving on 127\.0\.0\.1:\d+ for 3 requests", p.stdout)
    answers = dict(re.findall(r"prompt (\[.*?\]): ([\d ]+) \(done length\)", p.stdout))
    assert len(answers) == 3
    for prompt, tokens in answers.items():
        assert [int(t) for t in tokens.split()] == reference(json.loads(prompt), 6)
    once = re.search(r"one-shot generate \[7\]: (\[.*?\]) \(length\)", p.stdout)
    assert once and json.loads(once.group(1)) == reference([7], 4)


def test_modelcheck_example_finds_the_draft_bugs_and_passes_the_fix(tmp_path: Path) -> None:
    p = run("modelcheck_machine.py", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "cannot reach a terminal state: paused" in p.stdout
    assert "terminal but not absorbing: done" in p.stdout
    assert "fixed: no problems" in p.stdout
    assert "shortest path to failed: start -> give_up" in p.stdout
    assert "fuzz: passed" in p.stdout


def test_vendor_evidence_example_runs_every_runner(tmp_path: Path) -> None:
    p = run("vendor_evidence.py", "--out", "ev", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "two in flight: may be enabled" in p.stdout
    levels = dict(re.findall(r"^  (\w+)\s+(proven|failed|claimed|unknown)\s", p.stdout,
                             re.MULTILINE))
    assert levels["parallel_two_in_flight"] == "proven"
    assert levels["pingpong_overlap"] == "proven"
    assert levels["safe_cancel_after_timeout"] == "failed"
    assert len(levels) == len(CAPABILITIES)
    assert levels["batch_rows_independent"] == "proven"
    assert levels["graph_step_costs"] == levels["graph_kv_continuity"] == "proven"
    assert "shape buckets: may switch graphs" in p.stdout
    assert len(list((tmp_path / "ev").glob("*-sim-0.7.6.json"))) == 6
    assert len(list((tmp_path / "ev").glob("*-sim-0.7.6.md"))) == 6
    # the step costs are the calbin's: their file names it
    assert (tmp_path / "ev" / "step_costs-sim-tiny-buckets-0.7.6.json").is_file()


def test_custom_server_uses_every_embedder_feature(tmp_path: Path) -> None:
    """docs/embedding.md's server: request ids and abort, the live list, stop strings,
    n with logprobs, and the prompt cache serving the second turn of a chat."""
    p = run("custom_server.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert re.search(r"chat-1: \d+ chars, length", out) and "chat-2:" in out, out
    assert re.search(r"stop .*: stop, text is the text before it: True", out), out
    assert "n=2: choices [0, 1], distinct True, logprobs <= 0 True" in out, out
    assert "listed ['long-1-0'], DELETE 204, ended cancelled" in out, out
    hits = re.search(r"prompt cache: (\d+) hits, (\d+) tokens reused", out)
    assert hits and int(hits.group(1)) >= 1 and int(hits.group(2)) > 0, out
    assert len((EXAMPLES / "custom_server.py").read_text().splitlines()) < 200
