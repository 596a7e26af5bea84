"""The header, the Python binding and the emulator agree on the ABI."""

from __future__ import annotations

import re

import cffi

from calfsm.drivers import calrt
from calfsm.drivers.calrt import EMULATOR, REQUIRED, calbin_text, cdef_from_header, load_library
from calfsm.errors import CalrtCode
from calfsm.testing.conformance.util import small_calbin
from tests.native.util import NATIVE

HEADER = (NATIVE / "calrt_c.h").read_text("utf-8")


def _functions() -> set[str]:
    return set(re.findall(r"^(?:int32_t|uint32_t)\s+(calrt_\w+)\(", HEADER, flags=re.M))


def test_every_header_function_is_required_or_emulator_only() -> None:
    assert _functions() == set(REQUIRED) | set(EMULATOR)
    assert not set(REQUIRED) & set(EMULATOR)


def test_abi_version_constant_matches() -> None:
    m = re.search(r"#define CALRT_C_ABI_VERSION (\d+)u", HEADER)
    assert m and int(m.group(1)) == calrt.ABI_VERSION
    lib, _path, emulator = load_library(None)
    assert emulator and lib.calrt_abi_version() == calrt.ABI_VERSION


def test_cdef_parses_and_codes_match_calfsm() -> None:
    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header(HEADER))
    lib, _, _ = load_library(None)
    for name in re.findall(r"CALRT_([A-Z_]+) = \d+", HEADER):
        if hasattr(CalrtCode, name):
            assert getattr(lib, f"CALRT_{name}") == CalrtCode[name]


def test_calbin_text_round_trips_names_with_spaces_and_percent() -> None:
    cb = small_calbin(prefix="odd name%=é")
    text = calbin_text(cb).decode()
    assert "odd%20name%25%3D%C3%A9_decode" in text
    from calfsm.drivers.calrt import CalrtDriver
    with CalrtDriver() as d:
        assert d.configure(cb) == 0
        assert d.get_all_models() == (0, cb.models)
        assert d.model("odd name%=é_decode")[0] == 0


def test_every_fault_point_and_effect_has_its_c_enum() -> None:
    """CalrtDriver pushes a rule down as ``CALRT_EMU_POINT_<POINT>`` and
    ``CALRT_EMU_EFFECT_<EFFECT>``: each point and effect of faults.py has one, distinct,
    and the point count covers them."""
    from calfsm.drivers.faults import EFFECTS, FAULT_POINTS
    lib, _, _ = load_library(None)
    points = {getattr(lib, f"CALRT_EMU_POINT_{p.name.upper()}") for p in FAULT_POINTS}
    assert len(points) == len(FAULT_POINTS) == lib.CALRT_EMU_POINT_COUNT
    assert points == set(range(lib.CALRT_EMU_POINT_COUNT))
    effects = {e for es in EFFECTS.values() for e in es}
    assert len({getattr(lib, f"CALRT_EMU_EFFECT_{e.upper()}") for e in effects}) == len(effects)


def test_the_batch_calls_are_required_and_the_capability_has_its_field() -> None:
    for fn in ("calrt_set_batch_rows", "calrt_set_kv_seq_row", "calrt_set_csr_row",
               "calrt_get_row_status"):
        assert fn in REQUIRED
    assert "calrt_emu_set_batch_row_share" in EMULATOR
    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header(HEADER))
    assert "batch_rows" in dict(ffi.typeof("calrt_capabilities_t").fields)
