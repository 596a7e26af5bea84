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
