"""Bad input at the library boundary: a library that is missing, lacks a symbol or speaks
another ABI version is an Incompatible error at construction; NULL, garbage and stale
handles return a code from the C side (never a crash); calls after close are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from calfsm import _native
from calfsm.clock import VirtualClock
from calfsm.drivers import calrt
from calfsm.drivers.base import OutputStatus, ResetKind
from calfsm.drivers.calrt import REQUIRED, CalrtDriver, load_library
from calfsm.errors import CalrtCode as C
from calfsm.errors import ErrorCategory, Incompatible
from calfsm.manifest import TaskKind
from tests.drivers.util import prepare, run, setup, small_calbin
from tests.native.util import EMU_SOURCES, compile_c

CB = small_calbin(vocab=64, max_seq=64)


def _stub_library(tmp_path: Path, name: str, symbols: tuple[str, ...], abi: int) -> Path:
    src = tmp_path / f"{name}.c"
    body = [f"unsigned calrt_abi_version(void) {{ return {abi}u; }}"]
    body += [f"int {s}(void) {{ return 27; }}" for s in symbols if s != "calrt_abi_version"]
    src.write_text("\n".join(body) + "\n")
    out = tmp_path / f"lib{name}.so"
    compile_c(out, [src], shared=True)
    return out


def test_missing_library(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "libcalrt.so"
    with pytest.raises(Incompatible) as e:
        CalrtDriver(library=path)
    assert str(path) in e.value.message and "does not exist" in e.value.message
    assert e.value.category is ErrorCategory.COMPATIBILITY


def test_missing_library_from_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CALFSM_CALRT_LIB", str(tmp_path / "libshim.so"))
    with pytest.raises(Incompatible, match=r"libshim\.so"):
        CalrtDriver()


def test_not_a_shared_library(tmp_path: Path) -> None:
    bogus = tmp_path / "libbogus.so"
    bogus.write_text("not an ELF file\n")
    with pytest.raises(Incompatible, match="cannot be loaded"):
        CalrtDriver(library=bogus)


def test_library_lacking_a_symbol(tmp_path: Path) -> None:
    missing = "calrt_kv_apply"
    lib = _stub_library(tmp_path, "lacks", tuple(s for s in REQUIRED if s != missing), 1)
    with pytest.raises(Incompatible) as e:
        CalrtDriver(library=lib)
    assert missing in e.value.message and str(lib) in e.value.message


def test_abi_version_mismatch(tmp_path: Path) -> None:
    lib = _stub_library(tmp_path, "abi99", REQUIRED, 99)
    with pytest.raises(Incompatible) as e:
        CalrtDriver(library=lib)
    msg = e.value.message
    assert "99" in msg and f"version {calrt.ABI_VERSION}" in msg and str(lib) in msg


def test_vendor_library_without_emulator_controls(tmp_path: Path) -> None:
    # the emulator with only the ABI exported (no calrt_emu_*): what a vendor shim offers
    script = tmp_path / "abi.map"
    script.write_text("{ global: " + " ".join(f"{s};" for s in REQUIRED) + " local: *; };\n")
    lib = tmp_path / "libshim.so"
    compile_c(lib, EMU_SOURCES, "-O1", f"-Wl,--version-script={script}", shared=True)
    _lib, _path, emulator = load_library(lib)
    assert emulator is False
    from calfsm.drivers.faults import FaultPlan, FaultRule
    with pytest.raises(Incompatible, match="calrt_emu"):
        CalrtDriver(library=lib, faults=FaultPlan.of(FaultRule("infer", "hang")))
    with pytest.raises(Incompatible, match="virtual clock"):
        CalrtDriver(library=lib, clock=VirtualClock())
    with CalrtDriver.virtual(library=lib, latency=object(), kv_capacity=5) as d:
        assert not d.clock.virtual and not d.is_emulator     # a real device: real time
        d.configure(CB)
        dec = setup(d, CB, TaskKind.DECODE)
        assert run(d, dec, 0, [1], 0) == OutputStatus.DONE_OK
        from calfsm.drivers.timeline import phase_timeline
        assert d.timeline() is None and phase_timeline(d) is None   # host-side timing only


def test_unbuilt_bundled_library_says_how_to_build(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_native, "_HERE", tmp_path)
    monkeypatch.setattr(_native, "source_dir", lambda: None)
    monkeypatch.delenv("CALFSM_CALRT_LIB", raising=False)
    with pytest.raises(Incompatible) as e:
        load_library(None)
    assert "pip install" in e.value.message and "C compiler" in e.value.message


def test_autobuild_without_compiler(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_native, "find_compiler", lambda: None)
    with pytest.raises(_native.BuildError, match="no C compiler"):
        _native.build_library(tmp_path / "lib.so")


# ---- the C side never trusts a handle --------------------------------------------------

@pytest.fixture
def raw():
    lib, _path, _emu = load_library(None)
    ffi = calrt._get_ffi()
    return lib, ffi


def test_null_and_garbage_handles(raw) -> None:
    lib, ffi = raw
    st = ffi.new("int32_t *")
    ok = ffi.new("int32_t *")
    for h in (0, 1, 0xDEADBEEF, 2**64 - 1, (12345 << 20) | 7):
        assert lib.calrt_get_status(h, h, st) == C.INVALID_STATE
        assert lib.calrt_wait(h, h, 0) == C.INVALID_STATE
        assert lib.calrt_kv_apply(h, 0, 1, ok) == C.INVALID_STATE
        assert lib.calrt_device_close(h) == C.INVALID_STATE
    dev = ffi.new("calrt_device_t *")
    assert lib.calrt_device_open(ffi.NULL, dev) == 0
    d = dev[0]
    try:
        # NULL out-parameters and strings
        assert lib.calrt_device_open(ffi.NULL, ffi.NULL) == C.INVALID_VALUE
        assert lib.calrt_get_status(d, 0, ffi.NULL) == C.INVALID_VALUE
        assert lib.calrt_configure(d, ffi.NULL, 0) == C.INVALID_VALUE
        assert lib.calrt_model_lookup(d, ffi.NULL, ffi.new("calrt_model_t *")) \
            == C.INVALID_VALUE
        # garbage buffer and model handles of a live device
        for h in (0, 1, 2**64 - 1, (999999 << 20) | 3):
            assert lib.calrt_get_status(d, h, st) == C.INVALID_STATE
            assert lib.calrt_set_csr(d, h, b"cur_seq", 1) == C.INVALID_STATE
            assert lib.calrt_map_buf(d, h, b"x", ffi.NULL, 0, b"S32") == C.INVALID_STATE
            assert lib.calrt_release_buffer(d, h) == C.INVALID_STATE
        # a calbin that does not parse
        bad = b"calfsm-calbin 1\nmodel x decode -\ninput a S32 notanumber 1 1\nend\n"
        assert lib.calrt_configure(d, bad, len(bad)) == C.FILE_FORMAT_INVALID
        empty = b"calfsm-calbin 1\nend\n"
        assert lib.calrt_configure(d, empty, len(empty)) == C.INVALID_CALBIN
    finally:
        assert lib.calrt_device_close(d) == 0
    # the device handle is stale now
    assert lib.calrt_get_status(d, 0, st) == C.INVALID_STATE
    assert lib.calrt_configure(d, b"", 0) == C.INVALID_STATE
    assert lib.calrt_device_close(d) == C.INVALID_STATE


def test_stale_buffer_handle_after_destroy_and_reset(raw) -> None:
    d = CalrtDriver()
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    lib, ffi = raw
    st = ffi.new("int32_t *")
    stale_in, stale_out = dec.inp.handle, dec.out.handle
    assert d.destroy_buffers(dec.inp, dec.out) == 0
    assert lib.calrt_get_status(d._h, stale_out, st) == C.INVALID_STATE
    assert lib.calrt_set_kv_seq(d._h, stale_in, 0) == C.INVALID_STATE
    fresh = setup(d, CB, TaskKind.DECODE)
    assert d.reset(ResetKind.CONFIGURATION) == 0
    # stale by reset: status readable, everything else refused
    assert lib.calrt_get_status(d._h, fresh.out.handle, st) == 0
    assert lib.calrt_set_kv_seq(d._h, fresh.inp.handle, 0) == C.INVALID_STATE
    assert lib.calrt_wait(d._h, fresh.out.handle, 0) == C.INVALID_STATE
    d.close()


def test_calls_after_close_are_refused() -> None:
    d = CalrtDriver()
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    h = d._h
    d.close()
    assert d.infer(dec.model, dec.inp, dec.out) == C.INVALID_STATE
    assert d.wait(dec.out, 0.0) == C.INVALID_STATE
    assert d.map_buffer(dec.inp, "input_ids", np.zeros((1, 1), np.int32)) == C.INVALID_STATE
    assert d.kv_apply(0, 1) is False and d.kv_can_allocate(1) is False
    assert d.reset(ResetKind.FULL) == C.INVALID_STATE
    assert d.pending_jobs() == 0
    lib, _, _ = load_library(None)
    assert lib.calrt_kv_release(h, 0, 0) == C.INVALID_STATE      # the C handle is stale
    d.close()


def test_foreign_objects_are_invalid_state() -> None:
    d = CalrtDriver()
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    prepare(d, dec, 0, [1], 0)
    assert d.infer("model", dec.inp, dec.out) == C.INVALID_STATE
    assert d.infer(dec.model, object(), dec.out) == C.INVALID_STATE
    assert d.set_csr(None, "cur_seq", 1) == C.INVALID_STATE
    assert d.map_buffer(dec.inp, "input_ids\0", np.zeros((1, 1), np.int32)) == C.NOT_FOUND
    assert d.model("t_decode\0junk") == (C.NOT_FOUND, None)
    assert d.set_csr(dec.inp, "cur_seq", 2**70) == C.INVALID_VALUE
    assert d.slice_tensor(dec.inp, "input_ids", 2**70, 4) == C.OUT_OF_RANGE
    assert d.kv_apply(0, 2**70) is False
    assert d.kv_release(2**70, 0) == 0
    with pytest.raises(Exception, match="not an output buffer"):
        d.status(dec.inp)
    d.close()
