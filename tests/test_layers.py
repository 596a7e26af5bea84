"""The module layers of pyproject.toml hold: no import cycle among calfsm's modules, and no
module imports another package's private modules (``lint-imports``, import-linter)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.fail("lint-imports not installed: pip install -e '.[dev]'")
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "BROKEN" not in res.stdout and "KEPT" in res.stdout


def test_type_only_imports_count_too() -> None:
    """A cycle hidden under ``if TYPE_CHECKING:`` is still a cycle (eight modules once
    were one): the contract does not exclude type-only imports."""
    text = (ROOT / "pyproject.toml").read_text("utf-8")
    assert "exclude_type_checking_imports = false" in text


#: the modules a job passes through between ``enqueue`` and its result
CORE_PATH = ("engine/parts", "engine/admission", "engine/overlap", "engine/submission",
             "engine/completion", "engine/outcomes", "engine/pipeline", "generate/flow",
             "generate/stream", "generate/sequence", "runtime/drive", "engine/kv", "engine/buffers",
             "engine/readback", "engine/job")


@pytest.mark.parametrize("module", CORE_PATH)
def test_the_core_path_reads_in_one_sitting(module: str) -> None:
    """Issue 21: no class on the core path over 40 methods, no function over 60 lines
    (``Pipeline`` was one class of 97 methods and 1,346 lines before it was split)."""
    import ast

    tree = ast.parse((ROOT / "calfsm" / f"{module}.py").read_text("utf-8"))
    too_big = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [f for f in node.body
                       if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
            if len(methods) > 40:
                too_big.append(f"class {node.name}: {len(methods)} methods")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > 60:
                too_big.append(f"{node.name}: {lines} lines")
    assert not too_big, too_big


@pytest.mark.parametrize("module", ["engine/kv", "engine/buffers"])
def test_the_books_never_wait_and_read_no_clock(module: str) -> None:
    """Issue 21, item 4: the KV books and the pool grant now or refuse. Who waits, and
    until when, is the admission queue's (calfsm/engine/admission.py): these modules import no
    clock and construct no condition variable, event or timed wait."""
    import ast

    tree = ast.parse((ROOT / "calfsm" / f"{module}.py").read_text("utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in ("time", "calfsm.clock")]
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "calfsm.clock"):
            found.append(node.module)
        elif isinstance(node, ast.Attribute) and node.attr in (
                "Condition", "Event", "Semaphore", "sleep", "monotonic", "wait",
                "wait_for"):
            found.append(node.attr)
    assert not found, found


#: what the engine never imports: no thread primitive of its own (the runtime gives it
#: its locks and does its waiting), nothing that drives it or is built on it
ENGINE_NEVER_IMPORTS = ("threading", "asyncio", "calfsm.runtime", "calfsm.executor",
                        "calfsm.generate", "calfsm.serve", "calfsm.tools")


def _imported_by(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its tree: type-only imports
    (under ``if TYPE_CHECKING:``) and imports inside functions count too."""
    import ast

    package = "calfsm." + ".".join(path.relative_to(ROOT / "calfsm").with_suffix("").parts)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:          # relative: resolved against the module's package
                base = package.rsplit(".", node.level)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "calfsm" / "engine").glob("*.py")),
                         ids=lambda p: p.stem)
def test_the_engine_imports_no_thread_and_nothing_above_it(path: Path) -> None:
    """Issue 35: the engine is sans-thread and driven: it imports neither ``threading``
    nor ``asyncio`` (its locks come from the :class:`calfsm.engine.sync.Sync` it is built
    with; blocking waits live in calfsm/runtime/waits.py), and never the runtime, the
    facade, the generation API, the server or the tools."""
    found = sorted(name for name in _imported_by(path)
                   if any(name == banned or name.startswith(banned + ".")
                          for banned in ENGINE_NEVER_IMPORTS))
    assert not found, f"calfsm/engine/{path.name} imports {found}"
