"""Where the bundled CalRT emulator library lives, and how a source checkout builds it.

``pip install -e .`` and ``pip wheel .`` compile ``native/*.c`` into
``calfsm/_native/libcalrt_emu.so`` (``setup.py``) and copy the ABI header next to it. A
plain source checkout that was never installed (``python -m pytest`` straight from the
tree) has no library yet: :func:`library_path` then compiles it once with the machine's C
compiler (``$CC``, else ``cc``/``gcc``/``clang``) into this directory, and again whenever a
source under ``native/`` is newer than the library. Set ``CALFSM_NO_AUTOBUILD=1`` to
forbid that (a missing library is then reported, with the command that builds it).

The same library also exports calfsm's host-side kernels (``native/calfsm_kernels.h``,
not part of the CalRT ABI): :func:`load_kernels` opens them for :mod:`calfsm.engine.logits`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["HEADER_NAME", "KERNELS_VERSION", "LIBRARY_NAME", "SOURCES", "BuildError",
           "build_library", "header_path", "library_path", "load_kernels", "load_library",
           "source_dir"]

LIBRARY_NAME = "libcalrt_emu.so"
HEADER_NAME = "calrt_c.h"
#: the emulator's translation units, relative to ``native/``
SOURCES = ("calrt_emu.c", "emu_calbin.c", "emu_refmodel.c", "calfsm_kernels.c",
           "calfsm_sampling.c", "calfsm_tail.c")
#: flags of every build (setup.py uses the same)
CFLAGS = ("-std=c11", "-O2", "-g", "-fPIC", "-pthread", "-Wall", "-Wextra",
          "-fvisibility=default")
LDFLAGS = ("-shared", "-pthread", "-lm")

_HERE = Path(__file__).resolve().parent

BUILD_HINT = ('build it with `pip install -e ".[dev]"` (or `pip install .`) from the calfsm '
              "source tree, which needs a C compiler (gcc or clang), or point "
              "CALFSM_CALRT_LIB at a library implementing native/calrt_c.h")


class BuildError(RuntimeError):
    """The bundled library cannot be had: no compiler, a failed build, or (for
    :func:`load_kernels`) a library without the kernels this package needs."""


def source_dir() -> Path | None:
    """``native/`` of a source checkout, or None in an installed package."""
    d = _HERE.parent.parent / "native"
    return d if (d / HEADER_NAME).is_file() and (d / SOURCES[0]).is_file() else None


def header_path() -> Path | None:
    """The ABI header: the source tree's, else the copy installed with the package."""
    src = source_dir()
    if src is not None:
        return src / HEADER_NAME
    p = _HERE / HEADER_NAME
    return p if p.is_file() else None


def find_compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    return None


def build_library(out: Path, *, src: Path | None = None, cc: str | None = None,
                  extra_cflags: tuple[str, ...] = ()) -> Path:
    """Compile the emulator into ``out`` (atomically: a temporary file, then a rename)."""
    src = src or source_dir()
    if src is None:
        raise BuildError("the native/ sources are not available (installed package)")
    cc = cc or find_compiler()
    if cc is None:
        raise BuildError("no C compiler found (tried $CC, cc, gcc, clang): install gcc or "
                         "clang to build the CalRT emulator")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [*cc.split(), *CFLAGS, *extra_cflags, "-I", str(src), "-o", tmp,
           *(str(src / s) for s in SOURCES), *LDFLAGS]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise BuildError(f"compiling the CalRT emulator failed ({' '.join(cmd)}):\n"
                             f"{res.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _stale(lib: Path, src: Path) -> bool:
    if not lib.is_file():
        return True
    t = lib.stat().st_mtime
    return any(p.stat().st_mtime > t for p in src.iterdir() if p.suffix in (".c", ".h"))


def library_path() -> Path:
    """The bundled emulator, built first in a source checkout if missing or outdated.

    Raises :class:`BuildError` (with the way to build it) when it cannot be had."""
    lib = _HERE / LIBRARY_NAME
    src = source_dir()
    if src is not None and os.environ.get("CALFSM_NO_AUTOBUILD") != "1" and _stale(lib, src):
        build_library(lib, src=src)
    if not lib.is_file():
        raise BuildError(f"the bundled CalRT emulator {str(lib)!r} is not built: {BUILD_HINT}")
    return lib


#: ``CALFSM_KERNELS_VERSION`` of native/calfsm_kernels.h that this package speaks
KERNELS_VERSION = 1
#: the declarations of native/calfsm_kernels.h (that header is not installed)
KERNELS_CDEF = """
uint32_t calfsm_kernels_version(void);
int32_t calfsm_kernels_level(void);
int64_t calfsm_bf16_to_f32_finite(const uint16_t *src, float *dst, uint64_t n);
int64_t calfsm_bf16_to_f32_finite_at(const uint16_t *src, float *dst, uint64_t n,
                                     int32_t level);
"""


def load_library(cdef: str, what: str, version_call: str, version: int) -> tuple[Any, Any]:
    """``(ffi, lib)`` of the bundled library opened with ``cdef`` (cffi, ABI mode), once
    its ``version_call()`` answers ``version``: the one way calfsm's native parts (the
    kernels, the sampling kernel, the tail) are opened, each with its own declarations.

    Raises :class:`BuildError` when the library cannot be had (see :func:`library_path`),
    cannot be loaded, or lacks ``what`` at that version (an older build)."""
    import cffi  # only who uses a native part pays for the import

    path = library_path()
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    try:
        lib = ffi.dlopen(str(path))
        found = int(getattr(lib, version_call)())
    except (OSError, AttributeError) as e:
        raise BuildError(f"{str(path)!r} has no {what}: {e}") from None
    if found != version:
        raise BuildError(f"{str(path)!r} has {what} version {found}, this calfsm needs "
                         f"{version}: {BUILD_HINT}")
    return ffi, lib


def load_kernels() -> tuple[Any, Any]:
    """``(ffi, lib)`` of the host kernels in the bundled library (cffi, ABI mode).

    Raises :class:`BuildError` when the library cannot be had (see :func:`library_path`),
    cannot be loaded, or lacks the kernels of :data:`KERNELS_VERSION` (an older build)."""
    return load_library(KERNELS_CDEF, "calfsm kernels", "calfsm_kernels_version",
                        KERNELS_VERSION)
