"""calfsm/engine/tail.py declares native/calfsm_tail.h's row struct again (the header is
not installed with the package, so the module cannot read it at run time): the two must
stay the same struct, field for field, or the library reads a row at the wrong offsets.
Parsed here the way calfsm.drivers.calrt reads calrt_c.h (``cdef_from_header``) and
compared with the struct the module's rows are made of."""

from __future__ import annotations

import cffi
import pytest

from calfsm.drivers.calrt import cdef_from_header
from calfsm.engine import tail as T
from tests.native.util import NATIVE

pytestmark = pytest.mark.skipif(not T.native_tail_available(),
                                reason="the bundled library has no native tail")


def _header() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header((NATIVE / "calfsm_tail.h").read_text("utf-8")))
    return ffi


def test_the_row_struct_is_the_headers() -> None:
    ffi = _header()
    want = ffi.typeof("calfsm_tail_row")
    have = cffi.FFI().typeof(T.TailRow(8).c).item     # the struct the rows are made of
    assert [(n, f.offset, f.type.cname) for n, f in have.fields] == \
        [(n, f.offset, f.type.cname) for n, f in want.fields]
    assert ffi.sizeof(want) == ffi.sizeof(have)


def test_the_constants_are_the_headers() -> None:
    h = _header().dlopen(None)      # the header's #defines (no symbol is looked up)
    assert h.CALFSM_TAIL_VERSION == T.TAIL_VERSION
    for name in ("CONVERT", "GREEDY", "DRAW", "OK", "NONFINITE", "UNUSABLE", "EDRAW",
                 "SKIPPED"):
        assert getattr(h, f"CALFSM_TAIL_{name}") == getattr(T, name), name
