"""Build of the native part: the CalRT emulator ``calfsm/_native/libcalrt_emu.so``.

Everything else is in pyproject.toml. The emulator is a plain shared library (no Python
module: calfsm.drivers.calrt loads it with cffi's dlopen), so it is declared as an
``Extension`` whose output name is the bare ``libcalrt_emu.so`` and which exports no
``PyInit_`` symbol. ``pip install -e .`` builds it in place; ``pip wheel .`` puts it in the
wheel together with the ABI header ``calrt_c.h``. A machine without a C compiler gets a
clear error here, at build time.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SOURCES = ["native/calrt_emu.c", "native/emu_calbin.c", "native/emu_refmodel.c",
           "native/calfsm_kernels.c", "native/calfsm_sampling.c",
           "native/calfsm_tail.c"]
NAME = "calfsm._native.libcalrt_emu"


class BuildNative(build_ext):
    """build_ext for a dlopen()ed library: bare file name, no PyInit export, the header
    copied next to it, and a readable message when there is no compiler."""

    def get_ext_filename(self, fullname: str) -> str:
        # distutils passes the full dotted name or only its last component
        if fullname == NAME:
            return str(Path(*fullname.split("."))) + ".so"
        if fullname == NAME.rsplit(".", 1)[1]:
            return fullname + ".so"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return [] if ext.name == NAME else super().get_export_symbols(ext)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # CompileError, LinkError, missing compiler executable
            sys.stderr.write(
                "\nerror: could not compile the CalRT emulator (native/*.c) for calfsm: "
                f"{e}\nInstall a C compiler (e.g. `apt-get install gcc` or clang) and "
                "retry, or set CC to one.\n\n")
            raise
        if not self.inplace:  # a source tree reads native/calrt_c.h itself
            dest = Path(self.get_ext_fullpath(ext.name)).parent
            shutil.copyfile(HERE / "native" / "calrt_c.h", dest / "calrt_c.h")

    def run(self) -> None:
        if self.compiler is None and not shutil.which("cc") and not shutil.which("gcc") \
                and not shutil.which("clang"):
            import os
            if not os.environ.get("CC"):
                sys.stderr.write("\nerror: no C compiler found (cc, gcc, clang, $CC): "
                                 "calfsm builds its CalRT emulator from native/*.c and "
                                 "needs one. Install gcc or clang.\n\n")
                raise SystemExit(1)
        super().run()


setup(
    ext_modules=[Extension(
        NAME, sources=SOURCES, include_dirs=["native"],
        extra_compile_args=["-std=c11", "-O2", "-pthread", "-fvisibility=default"],
        extra_link_args=["-pthread"], libraries=["m"])],
    cmdclass={"build_ext": BuildNative},
)
