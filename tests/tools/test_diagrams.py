"""The committed machine pages are exactly what the declarations generate, and the
generator draws every transition the running machine has."""

from __future__ import annotations

from pathlib import Path

import pytest

from calfsm.machines import JOB_MACHINE, LIFECYCLE_MACHINE, DeclaredMachine
from calfsm.testing import explore
from calfsm.tools import diagrams

PAGES = Path(__file__).resolve().parents[2] / "docs" / "machines"


@pytest.mark.parametrize("name", sorted(diagrams.MACHINES))
def test_committed_page_is_current(name: str) -> None:
    machine, source = diagrams.MACHINES[name]
    committed = (PAGES / f"{name}.md").read_text("utf-8")
    assert committed == diagrams.render(machine, source), (
        f"docs/machines/{name}.md is stale: run `python -m calfsm.tools.diagrams`")


@pytest.mark.parametrize("name", sorted(diagrams.MACHINES))
def test_diagram_draws_every_edge_of_the_running_machine(name: str) -> None:
    machine, _ = diagrams.MACHINES[name]
    page = diagrams.render(machine)
    arrows = {line.strip() for line in page.splitlines() if "-->" in line}
    for edge in explore(machine).edges:
        guard = f" [{' and '.join(edge.guards)}]" if edge.guards else ""
        assert f"{edge.source} --> {edge.dest}: {edge.trigger}{guard}" in arrows
    assert f"[*] --> {machine.initial}" in arrows
    for state in machine.terminal:
        assert f"{state} --> [*]" in arrows


def test_job_page_shows_guard_initial_and_terminal() -> None:
    page = diagrams.render(JOB_MACHINE)
    assert "Completing --> Succeeded: succeed [deliverable]" in page
    assert "Declared in `calfsm/machines/job.py`." in page
    assert "class Succeeded,Failed,Quarantined terminal" in page
    assert "| `Created` | initial | `stage`, `admit`, `cancel`, `fail` |" in page
    assert "| `succeed` | `Completing` | `Succeeded` | `deliverable` |" in page
    assert page.count("```mermaid\nstateDiagram-v2\n") == 1


def test_render_is_deterministic() -> None:
    assert diagrams.render(LIFECYCLE_MACHINE) == diagrams.render(LIFECYCLE_MACHINE)


def test_render_handles_wildcards_internal_and_unless() -> None:
    def ready(event) -> bool:
        return True

    def jammed(event) -> bool:
        return False

    m = DeclaredMachine("toy", ["a", "b", "z"], [
        {"trigger": "go", "source": "a", "dest": "b", "conditions": [ready],
         "unless": [jammed]},
        {"trigger": "poke", "source": "b", "dest": None},
        {"trigger": "stay", "source": "a", "dest": "="},
        {"trigger": "stop", "source": "*", "dest": "z"},
    ], initial="a", terminal=["z"])
    page = diagrams.render(m)
    assert "a --> b: go [ready and not jammed]" in page
    assert "b --> b: poke (internal)" in page
    assert "a --> a: stay" in page
    for s in ("a", "b", "z"):
        assert f"{s} --> z: stop" in page
    assert "| `stop` | `a`, `b`, `z` | `z` | - |" in page
    assert "Declared in" not in page


def test_check_lists_stale_pages_and_write_fixes_them(tmp_path: Path, capsys) -> None:
    assert diagrams.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert all(f"{name}.md" in err for name in diagrams.MACHINES)

    assert diagrams.main(["--out", str(tmp_path)]) == 0
    assert diagrams.main(["--check", "--out", str(tmp_path)]) == 0

    kv = tmp_path / "kv.md"
    kv.write_text(kv.read_text("utf-8").replace("commit", "comit"), "utf-8")
    capsys.readouterr()
    assert diagrams.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "kv.md" in err and "job.md" not in err and "lifecycle.md" not in err
