"""The emulator under ThreadSanitizer and AddressSanitizer/LeakSanitizer.

``native/tests/stress.c`` drives one device from several pthreads (two engine slots,
concurrent submit/wait/status/KV, resets racing with jobs, STALE and HANG faults, close
with work pending) and checks every logit; built with ``-fsanitize=thread`` it must report
no data race, built with ``-fsanitize=address`` (LeakSanitizer on) no error and no leak.
A compiler that cannot build a sanitizer skips that variant with the compiler's reason.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.native.util import EMU_SOURCES, NATIVE, compile_c

STRESS = NATIVE / "tests" / "stress.c"


def _build(tmp_path: Path, sanitizer: str) -> Path:
    exe = tmp_path / f"stress-{sanitizer}"
    res = compile_c(exe, [STRESS, *EMU_SOURCES], f"-fsanitize={sanitizer}", "-O1",
                    "-fno-omit-frame-pointer", check=False)
    if res.returncode != 0:
        pytest.skip(f"the compiler cannot build -fsanitize={sanitizer}: "
                    f"{res.stderr.strip().splitlines()[-1] if res.stderr.strip() else '?'}")
    return exe


def _run(exe: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, check=False)
    if "unexpected memory mapping" in res.stderr or "FATAL: ThreadSanitizer" in res.stderr:
        # some kernels map memory where TSAN cannot run; retry without ASLR
        res = subprocess.run(["setarch", "-R", str(exe)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, **env}, check=False)
    return res


def test_stress_under_thread_sanitizer(tmp_path: Path) -> None:
    exe = _build(tmp_path, "thread")
    res = _run(exe, {"TSAN_OPTIONS": "halt_on_error=1 exitcode=66 second_deadlock_stack=1"})
    assert "ThreadSanitizer" not in res.stderr, res.stderr[-4000:]
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert "stress: ok" in res.stdout


def test_stress_under_address_and_leak_sanitizer(tmp_path: Path) -> None:
    exe = _build(tmp_path, "address")
    res = _run(exe, {"ASAN_OPTIONS": "detect_leaks=1 halt_on_error=1 exitcode=66",
                     "LSAN_OPTIONS": "exitcode=67"})
    assert "Sanitizer" not in res.stderr, res.stderr[-4000:]
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert "stress: ok" in res.stdout
