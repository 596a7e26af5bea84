"""Conformance: configuration, buffers, bad input and close (driver-protocol.md)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from calfsm.drivers.base import Calbin, EngineSlot, OutputStatus, ResetKind
from calfsm.errors import CalrtCode as C
from calfsm.manifest import TaskKind
from calfsm.testing.conformance.util import prepare, run, setup, small_calbin

CB = small_calbin(vocab=64, max_seq=64)
PRE = CB.models[0]
DEC = CB.models[1]


# ---- configuration ---------------------------------------------------------------------

def test_unconfigured(driver) -> None:
    assert driver.get_all_models() == (C.MISSING_CONFIG, None)
    assert driver.model(DEC.name) == (C.MISSING_CONFIG, None)


def test_configure_lists_models_in_order(driver) -> None:
    assert driver.configure(CB) == 0
    code, models = driver.get_all_models()
    assert code == 0
    assert [m.name for m in models] == [PRE.name, DEC.name]
    assert list(models) == list(CB.models)


def test_second_configure_refused_until_reset(driver) -> None:
    assert driver.configure(CB) == 0
    assert driver.configure(CB) == C.ALREADY_CONFIGURED
    assert driver.reset(ResetKind.CCU) == 0
    assert driver.configure(CB) == C.ALREADY_CONFIGURED
    assert driver.reset(ResetKind.CONFIGURATION) == 0
    assert driver.get_all_models() == (C.MISSING_CONFIG, None)
    assert driver.configure(CB) == 0


def test_empty_calbin_invalid(driver) -> None:
    assert driver.configure(Calbin(())) == C.INVALID_CALBIN
    assert driver.get_all_models() == (C.MISSING_CONFIG, None)


@pytest.mark.parametrize(("version", "code"), [
    (lambda v: v + ".1", C.RUNTIME_TOO_OLD),        # built for a newer runtime
    (lambda v: "0.0.1", C.DRIVER_INCOMPATIBLE),     # for an older one
    (lambda v: "not-a-version", C.DRIVER_INCOMPATIBLE),
])
def test_a_calbin_for_another_runtime_version_is_refused(driver, version, code) -> None:
    """A calbin is built for one CalRT version: configure refuses any other (spec 8,
    compatibility) and configures nothing; the right one still configures."""
    other = attrs.evolve(CB, calrt_version=version(driver.version()))
    assert driver.configure(other) == code
    assert driver.get_all_models() == (C.MISSING_CONFIG, None)
    assert driver.configure(attrs.evolve(CB, calrt_version=driver.version())) == 0


def test_model_lookup_is_exact(driver) -> None:
    driver.configure(CB)
    code, h = driver.model(DEC.name)
    assert code == 0 and h.name == DEC.name
    for wrong in (DEC.name[:-1], DEC.name + "x", DEC.name.upper(), "decode", ""):
        assert driver.model(wrong) == (C.NOT_FOUND, None)


# ---- buffers ---------------------------------------------------------------------------

@pytest.fixture
def dec(driver):
    driver.configure(CB)
    return setup(driver, CB, TaskKind.DECODE)


@pytest.fixture
def pre(driver):
    driver.configure(CB)
    return setup(driver, CB, TaskKind.PREFILL_IDS)


def test_map_wrong_dtype_size_direction_name(driver, dec) -> None:
    d = driver
    assert d.map_buffer(dec.inp, "input_ids", np.zeros((1, 1), np.float32)) == C.DTYPE_MISMATCH
    assert d.map_buffer(dec.inp, "input_ids", np.zeros((1, 1), np.int64)) == C.DTYPE_MISMATCH
    assert d.map_buffer(dec.inp, "input_ids", [0]) == C.DTYPE_MISMATCH
    assert d.map_buffer(dec.inp, "input_ids", np.zeros((1, 2), np.int32)) == C.SHAPE_MISMATCH
    assert d.map_buffer(dec.out, "logits", np.zeros(63, np.uint16)) == C.SHAPE_MISMATCH
    assert d.map_buffer(dec.out, "logits",
                        np.zeros(128, np.uint16)[::2]) == C.SHAPE_MISMATCH  # not contiguous
    assert d.map_buffer(dec.inp, "nope", np.zeros((1, 1), np.int32)) == C.NOT_FOUND
    assert d.map_buffer(dec.out, "input_ids", np.zeros((1, 1), np.int32)) == C.WRONG_DIRECTION
    assert d.map_buffer(dec.inp, "logits", np.zeros(64, np.uint16)) == C.WRONG_DIRECTION
    # a flat array of the right dtype and size is fine (the device sees bytes)
    assert d.map_buffer(dec.out, "logits", np.zeros(64, np.uint16)) == 0


def test_slice_bounds(driver, pre) -> None:
    d, size = driver, PRE.inputs[0].byte_size
    assert d.slice_tensor(pre.inp, "input_ids", 0, size) == 0
    assert d.slice_tensor(pre.inp, "input_ids", 0, size + 1) == C.OUT_OF_RANGE   # FI03
    assert d.slice_tensor(pre.inp, "input_ids", 4, size) == C.OUT_OF_RANGE
    assert d.slice_tensor(pre.inp, "input_ids", -4, 8) == C.OUT_OF_RANGE
    assert d.slice_tensor(pre.inp, "input_ids", 0, 0) == C.OUT_OF_RANGE
    assert d.slice_tensor(pre.inp, "input_ids", 0, -4) == C.OUT_OF_RANGE
    assert d.slice_tensor(pre.inp, "input_ids", 2, 8) == C.INVALID_VALUE
    assert d.slice_tensor(pre.inp, "input_ids", 0, 6) == C.INVALID_VALUE
    assert d.slice_tensor(pre.inp, "nope", 0, 4) == C.NOT_FOUND
    assert d.slice_tensor(pre.out, "input_ids", 0, 4) == C.WRONG_DIRECTION
    assert d.undo_slice(pre.inp, "input_ids") == 0
    assert d.undo_slice(pre.inp, "input_ids") == 0          # unsliced: still 0
    assert d.undo_slice(pre.inp, "nope") == C.NOT_FOUND


def test_undo_slice_makes_whole_tensor_active(driver, pre) -> None:
    d = driver
    prepare(d, pre, 0, [1, 2, 3], 0)
    assert d.undo_slice(pre.inp, "input_ids") == 0
    # 64 tokens active against 3 positions: the device refuses the job
    assert d.infer(pre.model, pre.inp, pre.out) == 0
    assert d.wait(pre.out, 1e6) == 0
    assert d.status(pre.out) == OutputStatus.DONE_CCU_EXCEPTION


def test_csr_and_kv_seq_values(driver, dec) -> None:
    d = driver
    assert d.set_csr(dec.inp, "cur_seq", 0) == 0
    assert d.set_csr(dec.inp, "cur_seq", 2**32 - 1) == 0
    assert d.set_csr(dec.inp, "cur_seq", 2**32) == C.INVALID_VALUE
    assert d.set_csr(dec.inp, "cur_seq", -1) == C.INVALID_VALUE
    assert d.set_csr(dec.inp, "cur_seqx", 1) == C.NOT_FOUND                       # FI02
    assert d.set_csr(dec.inp, "cur", 1) == C.NOT_FOUND
    assert d.set_kv_seq(dec.inp, 0) == 0
    assert d.set_kv_seq(dec.inp, 2**31 - 1) == 0
    assert d.set_kv_seq(dec.inp, 2**31) == C.INVALID_VALUE
    assert d.set_kv_seq(dec.inp, -1) == C.INVALID_VALUE


def test_fixed_engine_buffers_need_capability(driver) -> None:
    driver.configure(CB)
    _, h = driver.model(DEC.name)
    code, bufs = driver.create_buffers(h, EngineSlot.PING)
    if driver.capabilities().fixed_engine_slots:
        assert code == 0 and bufs is not None
    else:
        assert (code, bufs) == (C.UNSUPPORTED, None)


def test_infer_checks_in_order(driver) -> None:
    d = driver
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    pre = setup(d, CB, TaskKind.PREFILL_IDS)
    # buffers of another model
    assert d.infer(dec.model, pre.inp, pre.out) == C.INVALID_VALUE
    assert d.infer(dec.model, dec.inp, pre.out) == C.INVALID_VALUE
    # nothing set yet: CSRs and KV sequence missing
    assert d.infer(dec.model, dec.inp, dec.out) == C.MISSING_CONFIG
    d.set_csr(dec.inp, "cur_seq", 1)
    d.set_csr(dec.inp, "total_seq", 1)
    assert d.infer(dec.model, dec.inp, dec.out) == C.MISSING_CONFIG
    d.set_kv_seq(dec.inp, 0)
    d.kv_apply(0, 1)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.status(dec.out) in (OutputStatus.PENDING, OutputStatus.DONE_OK)


def test_infer_unmapped_tensor(driver) -> None:
    d = driver
    d.configure(CB)
    _, h = d.model(DEC.name)
    _, (inp, out) = d.create_buffers(h)
    d.map_buffer(inp, "input_ids", np.zeros((1, 1), np.int32))
    d.map_buffer(out, "logits", np.zeros((1, 1, 64), np.uint16))
    d.set_csr(inp, "cur_seq", 1)
    d.set_csr(inp, "total_seq", 1)
    d.set_kv_seq(inp, 0)
    assert d.infer(h, inp, out) == C.MISSING_CONFIG              # position_ids not mapped
    d.map_buffer(inp, "position_ids", np.zeros((1, 1), np.int32))
    d.kv_apply(0, 1)
    assert d.infer(h, inp, out) == 0


def test_buffers_of_another_driver_instance(make_driver) -> None:
    a, b = make_driver(), make_driver()
    a.configure(CB)
    b.configure(CB)
    da = setup(a, CB, TaskKind.DECODE)
    db = setup(b, CB, TaskKind.DECODE)
    prepare(b, db, 0, [1], 0)
    assert b.infer(db.model, da.inp, da.out) == C.INVALID_STATE
    assert b.infer(da.model, db.inp, db.out) == C.INVALID_STATE
    assert b.set_csr(da.inp, "cur_seq", 1) == C.INVALID_STATE
    assert b.map_buffer(da.out, "logits", da.logits) == C.INVALID_STATE
    assert b.wait(da.out, 0.0) == C.INVALID_STATE
    assert b.create_buffers(da.model) == (C.INVALID_STATE, None)


def test_wait_never_submitted(driver, dec) -> None:
    assert driver.wait(dec.out, 0.0) == C.INVALID_STATE
    assert driver.status(dec.out) == OutputStatus.IDLE
    assert driver.output_bytes(dec.out, "logits") == (C.INVALID_STATE, None)


def test_output_bytes(driver, dec) -> None:
    assert run(driver, dec, 0, [5], 0) == OutputStatus.DONE_OK
    assert driver.output_bytes(dec.out, "logits") == (0, DEC.outputs[0].byte_size)
    assert driver.output_bytes(dec.out, "nope") == (C.NOT_FOUND, None)


def test_wait_finished_returns_zero_again(driver, dec) -> None:
    assert run(driver, dec, 0, [5], 0) == OutputStatus.DONE_OK
    assert driver.wait(dec.out, 0.0) == 0
    assert driver.status(dec.out) == OutputStatus.DONE_OK


def test_destroy_buffers(driver, dec) -> None:
    d = driver
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    if d.status(dec.out) == OutputStatus.PENDING:
        assert d.destroy_buffers(dec.inp, dec.out) == C.DEVICE_BUSY
    assert d.wait(dec.out, 1e6) == 0
    assert d.destroy_buffers(dec.inp, dec.out) == 0
    assert d.set_csr(dec.inp, "cur_seq", 1) == C.INVALID_STATE
    assert d.infer(dec.model, dec.inp, dec.out) == C.INVALID_STATE
    assert d.destroy_buffers(dec.inp, dec.out) == C.INVALID_STATE


def test_stale_handles_after_configuration_reset(driver, dec) -> None:
    d = driver
    assert d.reset(ResetKind.CONFIGURATION) == 0
    assert d.configure(CB) == 0
    assert d.set_csr(dec.inp, "cur_seq", 1) == C.INVALID_STATE
    assert d.map_buffer(dec.inp, "input_ids", dec.tok) == C.INVALID_STATE
    assert d.create_buffers(dec.model) == (C.INVALID_STATE, None)
    code, h = d.model(DEC.name)
    assert code == 0
    assert d.infer(h, dec.inp, dec.out) == C.INVALID_STATE
    fresh = setup(d, CB, TaskKind.DECODE)
    assert run(d, fresh, 0, [1], 0) == OutputStatus.DONE_OK


def test_unsupported_reset_kind(make_driver) -> None:
    d = make_driver()
    for kind in ResetKind:
        if not d.capabilities().can_reset(kind):
            assert d.reset(kind) == C.UNSUPPORTED


def test_sim_without_capabilities() -> None:
    from calfsm.drivers.base import Capabilities
    from calfsm.drivers.sim import SimDriver
    d = SimDriver(capabilities=Capabilities(resets=frozenset({ResetKind.CCU})))
    d.configure(CB)
    assert d.reset(ResetKind.FULL) == C.UNSUPPORTED
    assert d.enable_parallel_mode(True) == C.UNSUPPORTED
    _, h = d.model(DEC.name)
    assert d.create_buffers(h, EngineSlot.PONG) == (C.UNSUPPORTED, None)


# ---- close -----------------------------------------------------------------------------

def test_close_then_refused(driver, dec) -> None:
    d = driver
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    pending = d.status(dec.out) == OutputStatus.PENDING
    d.close()
    if pending:
        assert d.status(dec.out) == OutputStatus.DONE_ABORTED
    assert d.configure(CB) == C.INVALID_STATE
    assert d.get_all_models() == (C.INVALID_STATE, None)
    assert d.model(DEC.name) == (C.INVALID_STATE, None)
    assert d.create_buffers(dec.model) == (C.INVALID_STATE, None)
    assert d.map_buffer(dec.inp, "input_ids", dec.tok) == C.INVALID_STATE
    assert d.slice_tensor(dec.inp, "input_ids", 0, 4) == C.INVALID_STATE
    assert d.undo_slice(dec.inp, "input_ids") == C.INVALID_STATE
    assert d.set_csr(dec.inp, "cur_seq", 1) == C.INVALID_STATE
    assert d.set_kv_seq(dec.inp, 1) == C.INVALID_STATE
    assert d.infer(dec.model, dec.inp, dec.out) == C.INVALID_STATE
    assert d.infer_fixed(dec.model, dec.inp, dec.out, EngineSlot.PING) == C.INVALID_STATE
    assert d.wait(dec.out, 0.0) == C.INVALID_STATE
    assert d.output_bytes(dec.out, "logits") == (C.INVALID_STATE, None)
    assert d.kv_can_allocate(1) is False
    assert d.kv_apply(0, 1) is False
    assert d.kv_release(0) == C.INVALID_STATE
    assert d.reset(ResetKind.CCU) == C.INVALID_STATE
    assert d.enable_parallel_mode(True) == C.INVALID_STATE
    assert d.destroy_buffers(dec.inp, dec.out) == C.INVALID_STATE
    d.close()  # twice is harmless


def test_calbin_roundtrip_accepted(driver, tmp_path) -> None:
    cb = Calbin.load(CB.save(tmp_path / "x.calbin.json"))
    assert driver.configure(cb) == 0
    assert attrs.evolve(cb).models == CB.models
