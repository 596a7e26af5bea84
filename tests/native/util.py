"""Helpers of the native tests: compile C with the machine's compiler into a temp dir."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from calfsm import _native

NATIVE = Path(__file__).resolve().parents[2] / "native"
EMU_SOURCES = [NATIVE / s for s in _native.SOURCES]


def compiler() -> str:
    cc = _native.find_compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine")
    return cc


def compile_c(out: Path, sources: list[Path], *flags: str, shared: bool = False,
              check: bool = True) -> subprocess.CompletedProcess:
    cmd = [*compiler().split(), "-std=c11", "-g", "-pthread", "-I", str(NATIVE), *flags,
           "-o", str(out), *map(str, sources), "-lm"]
    if shared:
        cmd[1:1] = ["-shared", "-fPIC"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return res
