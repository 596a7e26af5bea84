"""CalrtDriver: the Driver protocol over the C ABI of ``native/calrt_c.h`` (cffi, ABI mode).

Theory of operation
-------------------
The library behind the driver is either the bundled emulator ``libcalrt_emu.so`` (built
from ``native/`` by ``pip install``; the default) or a vendor shim over CalRT 0.7.6
(``library=`` or ``$CALFSM_CALRT_LIB``; see ``docs/vendor-shim.md``). It is loaded with
``ffi.dlopen`` against the declarations of the header itself, then checked: the file
exists, exports every ABI function, and reports :data:`ABI_VERSION` — any failure is an
:class:`~calfsm.errors.Incompatible` (category *compatibility*) naming the path, the symbol
or both versions, raised at construction, never a crash later.

Every C call goes through one place, :meth:`CalrtDriver._c`, which records the trace and
returns the CalRT code; the few calls that must succeed for the driver to stay coherent
(reading model metadata after ``configure``) raise the classified error of
:func:`calfsm.errors.from_calrt` naming the function and its arguments.

Handles are small Python objects wrapping the library's 64-bit handles (index +
generation), tagged with their driver and configuration epoch, so a handle of another
driver, a destroyed buffer or one from before a configuration reset is refused with the
code ``docs/driver-protocol.md`` gives — in Python where the rule is about Python objects,
in C otherwise (the library re-checks everything and never trusts a stale handle).

Host memory: ``map_buffer`` hands the library the address of the numpy array and keeps a
reference to the array in the buffer object, so it stays alive and unmoved while the
device may read or write it (the device thread touches it when the job *executes*). When
a buffer object is garbage collected its handle is released; if a job still uses it (a
STALE job surviving a reset) the arrays are parked until the library reports no pending
job.

Time: with the default :class:`~calfsm.clock.RealClock` the emulator runs in real time (a
job finishes on the device thread when its latency has elapsed; ``wait`` blocks without
the GIL). With a :class:`~calfsm.clock.VirtualClock` the emulator follows that clock:
device time moves only through ``wait`` (and whoever advances the clock), exactly like
:class:`~calfsm.drivers.sim.SimDriver` — the jobs still execute on the device thread.

Phases: the emulator models one DMA channel and one compute unit like SimDriver (the
``transfer_share`` of a :class:`~calfsm.drivers.sim.LatencyModel` is pushed down with
the rest of it) and keeps a ring of the last ``timeline_jobs`` ended jobs, which
:meth:`CalrtDriver.timeline` reads; on a vendor library the timeline is None. The trace
(of C calls) is off by default, ``trace=True`` keeps every call, ``trace=N`` the last N.

Faults: a :class:`~calfsm.drivers.faults.FaultPlan` is pushed down as rules
(``calrt_emu_add_rule``); the emulator applies them with the plan's counting rules at the
points where SimDriver does.

Batches: a model whose tensors are ``[B, ...]`` runs jobs of 1..B rows
(``docs/driver-protocol.md``, Batches): ``set_batch_rows``, ``set_kv_seq``/``set_csr``
with ``row=`` and ``row_status`` are ``calrt_set_batch_rows``, ``calrt_set_kv_seq_row``,
``calrt_set_csr_row`` and ``calrt_get_row_status`` (row 0 uses the single-row calls), and
``Capabilities.batch_rows`` is the library's ``batch_rows`` capability.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cffi
import numpy as np

from calfsm import _native
from calfsm.clock import Clock, RealClock, VirtualClock
from calfsm.drivers.base import SEQ_LIMIT as _SEQ_LIMIT
from calfsm.drivers.base import U32_MAX as _U32_MAX
from calfsm.drivers.base import (
    Calbin,
    Capabilities,
    ClosesOnExit,
    EngineSlot,
    HandleChecks,
    JobTag,
    OutputStatus,
    ResetKind,
    runtime_code,
    tensor_table,
    wait_timeout,
)
from calfsm.drivers.base import is_int as _is_int
from calfsm.drivers.faults import FaultPlan
from calfsm.drivers.timeline import DEFAULT_TIMELINE_JOBS, JobRing, PhaseSpan, spans_of_job
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Incompatible,
    InvalidArgument,
    code_name,
    from_calrt,
)
from calfsm.manifest import DType, Manifest, ModelInfo, TaskKind, TensorInfo

__all__ = ["ABI_VERSION", "CalrtDriver", "cdef_from_header", "load_library"]

#: the ABI this module speaks (``CALRT_C_ABI_VERSION`` of native/calrt_c.h)
ABI_VERSION = 2

_OK = 0
_NOT_FOUND = int(CalrtCode.NOT_FOUND)
_INVALID_VALUE = int(CalrtCode.INVALID_VALUE)
_INVALID_STATE = int(CalrtCode.INVALID_STATE)
_MISSING_CONFIG = int(CalrtCode.MISSING_CONFIG)
_DEVICE_BUSY = int(CalrtCode.DEVICE_BUSY)
_INVALID_CALBIN = int(CalrtCode.INVALID_CALBIN)
_WRONG_DIRECTION = int(CalrtCode.WRONG_DIRECTION)
_DTYPE_MISMATCH = int(CalrtCode.DTYPE_MISMATCH)
_OUT_OF_RANGE = int(CalrtCode.OUT_OF_RANGE)

_I64_MAX = 2**63 - 1
#: timeline records of pending jobs read beyond the ring (two in flight, and ghosts)
_MAX_PENDING = 64
_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1
#: a name no model, tensor or CSR can have (longer than CALRT_NAME_MAX)
_NO_NAME = b"?" * 300

_KINDS = {0: TaskKind.PREFILL_IDS, 1: TaskKind.PREFILL_EMBEDS, 2: TaskKind.DECODE,
          3: TaskKind.VISION}
_RESET_BITS = {ResetKind.CCU: 1, ResetKind.CONFIGURATION: 2, ResetKind.FULL: 4}
_RESET_FN = {ResetKind.CCU: "calrt_reset_ccu",
             ResetKind.CONFIGURATION: "calrt_reset_configuration",
             ResetKind.FULL: "calrt_reset"}

#: functions every library must export; the calrt_emu_* ones only the emulator
REQUIRED = (
    "calrt_abi_version", "calrt_runtime_version", "calrt_device_open", "calrt_device_close",
    "calrt_get_capabilities", "calrt_configure", "calrt_model_count", "calrt_model_at",
    "calrt_model_lookup", "calrt_model_info", "calrt_model_tensor", "calrt_model_csr",
    "calrt_create_buffers", "calrt_destroy_buffers", "calrt_release_buffer", "calrt_map_buf",
    "calrt_slice_tensor", "calrt_undo_slice", "calrt_set_csr", "calrt_set_kv_seq",
    "calrt_infer", "calrt_infer_fixed", "calrt_wait", "calrt_get_status",
    "calrt_output_bytes", "calrt_pending_jobs", "calrt_kv_can_allocate", "calrt_kv_apply",
    "calrt_kv_release", "calrt_reset_ccu", "calrt_reset_configuration", "calrt_reset",
    "calrt_enable_parallel_mode", "calrt_set_batch_rows", "calrt_set_kv_seq_row",
    "calrt_set_csr_row", "calrt_get_row_status",
)
EMULATOR = (
    "calrt_emu_set_clock", "calrt_emu_now", "calrt_emu_advance", "calrt_emu_advance_to",
    "calrt_emu_set_latency", "calrt_emu_set_kv_capacity", "calrt_emu_set_capabilities",
    "calrt_emu_add_rule", "calrt_emu_clear_rules", "calrt_emu_stats",
    "calrt_emu_set_transfer_share", "calrt_emu_set_timeline", "calrt_emu_timeline",
    "calrt_emu_set_batch_row_share", "calrt_emu_set_shape_cost",
)


# ---------------------------------------------------------------------------------------
# loading


def cdef_from_header(text: str) -> str:
    """The cffi declarations of ``calrt_c.h``: comments, include guards and C++ wrappers
    dropped, integer ``#define``\\ s kept (cffi understands those)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"#define\s+(\w+)\s+(\d+)u?$", s)
        if m:
            out.append(f"#define {m.group(1)} {m.group(2)}")
        elif s and not s.startswith("#") and s not in ('extern "C" {', "}"):
            out.append(line.rstrip())
    return "\n".join(out) + "\n"


_ffi: cffi.FFI | None = None
_libs: dict[str, Any] = {}
_load_lock = threading.Lock()


def _get_ffi() -> cffi.FFI:
    global _ffi
    if _ffi is None:
        hp = _native.header_path()
        if hp is None:
            raise Incompatible("the C ABI header calrt_c.h is not installed with calfsm: "
                               + _native.BUILD_HINT, stage="driver")
        ffi = cffi.FFI()
        ffi.cdef(cdef_from_header(hp.read_text("utf-8")))
        _ffi = ffi
    return _ffi


def load_library(path: str | os.PathLike | None = None) -> tuple[Any, str, bool]:
    """``(lib, path, is_emulator)`` for a CalRT ABI library; the bundled emulator when
    ``path`` and ``$CALFSM_CALRT_LIB`` are unset. Raises :class:`Incompatible`."""
    with _load_lock:
        ffi = _get_ffi()
        if path is None:
            path = os.environ.get("CALFSM_CALRT_LIB") or None
        if path is None:
            try:
                path = _native.library_path()
            except _native.BuildError as e:
                raise Incompatible(str(e), stage="driver") from None
        path = str(Path(path).resolve()) if Path(path).exists() else str(path)
        if path in _libs:
            return _libs[path]
        if not Path(path).is_file():
            raise Incompatible(f"CalRT library {path!r} does not exist: "
                               + _native.BUILD_HINT, stage="driver")
        try:
            lib = ffi.dlopen(path)
        except OSError as e:
            raise Incompatible(f"CalRT library {path!r} cannot be loaded: {e}",
                               stage="driver") from None
        for sym in REQUIRED:
            try:
                getattr(lib, sym)
            except AttributeError:
                raise Incompatible(f"CalRT library {path!r} lacks the symbol {sym!r}: it "
                                   f"does not implement calrt_c.h ABI {ABI_VERSION}",
                                   stage="driver") from None
        abi = int(lib.calrt_abi_version())
        if abi != ABI_VERSION:
            raise Incompatible(f"CalRT library {path!r} implements calrt_c.h ABI version "
                               f"{abi}, calfsm needs version {ABI_VERSION}: rebuild the "
                               "library against this calfsm's native/calrt_c.h",
                               stage="driver")
        emulator = True
        for sym in EMULATOR:
            try:
                getattr(lib, sym)
            except AttributeError:
                emulator = False
                break
        _libs[path] = (lib, path, emulator)
        return _libs[path]


# ---------------------------------------------------------------------------------------
# calbin description


def _enc(s: str) -> str:
    if s == "":
        return "="
    out = []
    for b in s.encode("utf-8"):
        if b <= 0x20 or b >= 0x7F or b in (0x25, 0x3D):
            out.append(f"%{b:02X}")
        else:
            out.append(chr(b))
    return "".join(out)


def calbin_text(calbin: Calbin) -> bytes:
    """The line format ``calrt_configure`` takes (documented in calrt_c.h)."""
    lines = ["calfsm-calbin 1", f"sha256 {_enc(calbin.sha256)}",
             f"calrt_version {_enc(calbin.calrt_version)}"]
    for m in calbin.models:
        kind = m.kind.value if m.kind is not None else "-"
        d0 = "-" if m.tile_d0 is None else str(int(m.tile_d0))
        lines.append(f"model {_enc(m.name)} {kind} {d0}")
        for direction, ts in (("input", m.inputs), ("output", m.outputs)):
            for t in ts:
                dims = " ".join(str(int(x)) for x in t.shape)
                lines.append(f"{direction} {_enc(t.name)} {DType(t.dtype).value} "
                             f"{int(t.byte_size)} {len(t.shape)}" + (f" {dims}" if dims else ""))
        lines.extend(f"csr {_enc(c)}" for c in m.csr_names)
    lines.append("end")
    return ("\n".join(lines) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------
# handles


class _Model:
    __slots__ = ("__weakref__", "driver", "epoch", "handle", "info", "name", "tensors")

    def __init__(self, driver: CalrtDriver, handle: int, info: ModelInfo, epoch: int) -> None:
        self.driver = driver
        self.handle = handle
        self.info = info
        self.name = info.name
        self.epoch = epoch
        self.tensors = tensor_table(info)

    def __repr__(self) -> str:
        return f"<calrt model {self.name!r}>"


class _Buf:
    __slots__ = (
        "__weakref__",
        "destroyed",
        "driver",
        "epoch",
        "finalizer",
        "handle",
        "is_input",
        "label",
        "maps",
        "model",
        "rows_final",
        "status",
    )

    def __init__(self, driver: CalrtDriver, model: _Model, handle: int, is_input: bool,
                 label: str) -> None:
        self.driver = driver
        self.model = model
        self.handle = handle
        self.is_input = is_input
        self.label = label
        self.epoch = model.epoch
        self.destroyed = False
        #: tensor name -> the mapped host array (kept alive while the device may use it)
        self.maps: dict[str, np.ndarray] = {}
        self.status = OutputStatus.IDLE
        #: output: every row's status when the buffer was destroyed or the driver closed
        #: (what ``row_status`` answers once the library cannot)
        self.rows_final: tuple[OutputStatus, ...] | None = None
        self.finalizer: weakref.finalize | None = None

    def __repr__(self) -> str:
        return f"<calrt buffer {self.label} of {self.model.name!r}>"


class _Device:
    """What outlives the driver object for cleanup: the library, the device handle and the
    host arrays parked while a job may still write them."""

    def __init__(self, lib: Any, handle: int) -> None:
        self.lib = lib
        self.handle = handle
        # re-entrant: a buffer finalizer may run (GC) in a thread that holds it
        self.lock = threading.RLock()
        self.closed = False
        self.parked: list[dict[str, np.ndarray]] = []

    def release(self, buf_handle: int, maps: dict[str, np.ndarray]) -> None:
        with self.lock:
            if self.closed:
                return
            rc = self.lib.calrt_release_buffer(self.handle, buf_handle)
            if rc == _DEVICE_BUSY:
                self.parked.append(maps)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.lib.calrt_device_close(self.handle)
            self.parked.clear()


def _release(dev: _Device, handle: int, maps: dict[str, np.ndarray]) -> None:
    dev.release(handle, maps)


def _must_succeed(rc: int, fn: str, *args: Any) -> None:
    """For the calls the driver cannot stay coherent without (opening the device, reading
    model metadata, emulator set-up): raises the classified CalRT error naming the
    function, its arguments and the code."""
    if rc != 0:
        shown = ", ".join(repr(a) for a in args)
        raise from_calrt(rc, fn, f"{fn}({shown}) returned {rc} ({code_name(rc)})")



def _clamp(x: int, lo: int, hi: int) -> int:
    return lo if x < lo else hi if x > hi else int(x)


def _row(row: int) -> int:
    """A row index for C (``uint32_t``): one beyond it is beyond every batch too."""
    return _clamp(row, 0, _U32_MAX)


def _batch(info: ModelInfo) -> int:
    """B of a model as the device reads it: the first dimension of its token tensor when
    that has one (``[B, n]`` ids, ``[B, n, hidden]`` embeddings), else 1."""
    shape = info.inputs[0].shape if info.inputs else ()
    rank = 3 if info.kind is TaskKind.PREFILL_EMBEDS else 2
    return int(shape[0]) if len(shape) >= rank else 1


def _cname(name: Any) -> bytes:
    """A name for C; one that cannot exist when ``name`` is not a plain string."""
    if not isinstance(name, str) or "\0" in name:
        return _NO_NAME
    b = name.encode("utf-8")
    return b if len(b) < 256 else _NO_NAME


# ---------------------------------------------------------------------------------------


class CalrtDriver(ClosesOnExit, HandleChecks):
    """The Driver protocol over a CalRT ABI library. See the module docstring."""

    name = "calrt"
    _MODEL = _Model
    _BUF = _Buf

    def __init__(self, manifest_or_calbin: Manifest | Calbin | None = None, *,
                 library: str | os.PathLike | None = None, faults: FaultPlan | None = None,
                 latency: Any = None, kv_capacity: int = 1 << 20, seed: int = 0,
                 clock: Clock | None = None, capabilities: Capabilities | None = None,
                 trace: bool | int = False, options: str = "",
                 timeline_jobs: int = DEFAULT_TIMELINE_JOBS) -> None:
        if isinstance(manifest_or_calbin, Manifest):
            manifest_or_calbin = Calbin.from_manifest(manifest_or_calbin)
        if manifest_or_calbin is not None and not isinstance(manifest_or_calbin, Calbin):
            raise InvalidArgument(f"CalrtDriver takes a Manifest or a Calbin, got "
                                  f"{type(manifest_or_calbin).__name__}", stage="driver")
        if not _is_int(kv_capacity) or kv_capacity < 0:
            raise InvalidArgument(f"kv_capacity must be >= 0, got {kv_capacity!r}",
                                  stage="driver")
        self.faults = faults if faults is not None else FaultPlan.none()
        if not isinstance(self.faults, FaultPlan):
            raise InvalidArgument("faults must be a FaultPlan", stage="driver")
        #: the calbin this device is meant to be configured with
        self.calbin: Calbin | None = manifest_or_calbin
        self.seed = int(seed)
        self.clock: Clock = clock if clock is not None else RealClock()
        self._virtual = bool(getattr(self.clock, "virtual", False))
        self._kv_capacity = int(kv_capacity)
        self._lib, self.library_path, self._emulator = load_library(library)
        self._ffi = _get_ffi()
        self._lock = threading.RLock()
        self._trace = _trace_store(trace)
        JobRing(timeline_jobs)          # the same argument check as SimDriver's
        self._timeline_jobs = int(timeline_jobs)
        #: the timeline read at close, so it stays readable afterwards
        self._final_timeline: list[PhaseSpan] | None = None
        self._closed = False
        self._epoch = 0
        self._configured = False
        self._infos: tuple[ModelInfo, ...] = ()
        self._models: dict[str, _Model] = {}
        self._nbufs = 0
        self._outs: weakref.WeakSet[_Buf] = weakref.WeakSet()

        if not self._emulator:
            # a vendor library drives a real device: its latency, KV capacity and
            # capabilities are the device's own, and only the emulator can inject faults
            # or follow a virtual clock
            if self.faults or self._virtual:
                raise Incompatible(
                    f"CalRT library {self.library_path!r} has no calrt_emu_* control "
                    f"functions, needed for {'a fault plan' if self.faults else 'a virtual clock'}",
                    stage="driver")
            latency = capabilities = None
            self._timeline_jobs = 0
        out = self._ffi.new("calrt_device_t *")
        _must_succeed(self._lib.calrt_device_open(options.encode(), out), "calrt_device_open")
        self._dev = _Device(self._lib, int(out[0]))
        self._finalizer = weakref.finalize(self, _Device.close, self._dev)
        try:
            self._setup_emulator(latency, capabilities)
        except BaseException:
            self.close()
            raise
        caps = self._ffi.new("calrt_capabilities_t *")
        _must_succeed(self._lib.calrt_get_capabilities(self._h, caps), "calrt_get_capabilities")
        self._caps = Capabilities(
            resets=frozenset(k for k, bit in _RESET_BITS.items() if caps.resets & bit),
            parallel_mode=bool(caps.parallel_mode),
            fixed_engine_slots=bool(caps.fixed_engine_slots),
            engine_slots=int(caps.engine_slots),
            batch_rows=bool(caps.batch_rows))

    @classmethod
    def virtual(cls, **kw: Any) -> CalrtDriver:
        """A driver whose device follows a fresh :class:`~calfsm.clock.VirtualClock`
        (deterministic, nothing sleeps: what the conformance suite runs) — on the
        emulator; a vendor library (no ``calrt_emu_*``) keeps its real clock."""
        _lib, _path, emulator = load_library(kw.get("library"))
        if emulator:  # a vendor library runs in real time (the device is real)
            kw.setdefault("clock", VirtualClock())
        return cls(**kw)

    def _setup_emulator(self, latency: Any, capabilities: Capabilities | None) -> None:
        if not self._emulator:
            return
        lib, h = self._lib, self._h
        if self._virtual:
            _must_succeed(lib.calrt_emu_set_clock(h, 1), "calrt_emu_set_clock", 1)
            _must_succeed(lib.calrt_emu_advance_to(h, _ns(self.clock.now())),
                          "calrt_emu_advance_to")
        if latency is not None:
            jitter = float(getattr(latency, "jitter", 0.0) or 0.0)
            _must_succeed(lib.calrt_emu_set_latency(
                h, float(latency.h2d_s_per_byte), float(latency.prefill_per_token_s),
                float(latency.decode_s), float(latency.d2h_s_per_byte), jitter,
                self.seed & 0xFFFFFFFF), "calrt_emu_set_latency", latency)
            share = float(getattr(latency, "transfer_share", 0.0) or 0.0)
            _must_succeed(lib.calrt_emu_set_transfer_share(h, share),
                          "calrt_emu_set_transfer_share", share)
            rows = float(getattr(latency, "batch_row_share", 0.0) or 0.0)
            _must_succeed(lib.calrt_emu_set_batch_row_share(h, rows),
                          "calrt_emu_set_batch_row_share", rows)
            graph = int(getattr(latency, "shape_cost", "rows") == "graph")
            context = float(getattr(latency, "context_token_s", 0.0) or 0.0)
            _must_succeed(lib.calrt_emu_set_shape_cost(h, graph, context),
                          "calrt_emu_set_shape_cost", graph, context)
        _must_succeed(lib.calrt_emu_set_timeline(h, self._timeline_jobs),
                      "calrt_emu_set_timeline", self._timeline_jobs)
        _must_succeed(lib.calrt_emu_set_kv_capacity(h, min(self._kv_capacity, _U64_MAX)),
              "calrt_emu_set_kv_capacity")
        if capabilities is not None:
            c = self._ffi.new("calrt_capabilities_t *")
            c.resets = sum(_RESET_BITS[k] for k in capabilities.resets)
            c.parallel_mode = int(capabilities.parallel_mode)
            c.fixed_engine_slots = int(capabilities.fixed_engine_slots)
            c.engine_slots = int(capabilities.engine_slots)
            c.batch_rows = int(capabilities.batch_rows)
            _must_succeed(lib.calrt_emu_set_capabilities(h, c), "calrt_emu_set_capabilities")
        for rule in self.faults.rules:   # every field is in range of its C type (FaultRule)
            r = self._ffi.new("calrt_emu_rule_t *")
            r.point = getattr(lib, f"CALRT_EMU_POINT_{rule.point.upper()}")
            r.effect = getattr(lib, f"CALRT_EMU_EFFECT_{rule.effect.upper()}")
            r.nth = rule.nth
            r.every = rule.every or 0
            r.limit = -1 if rule.limit is None else rule.limit
            r.seq_id = -1 if rule.seq_id is None else rule.seq_id
            r.has_job_id = rule.job_id is not None
            r.job_id = rule.job_id if rule.job_id is not None else 0
            r.has_name = rule.name is not None
            if rule.name is not None:
                r.name = _cname(rule.name)
            r.code = rule.effective_code if rule.effect == "code" else 0
            r.n_bytes = -1 if rule.n_bytes is None else rule.n_bytes
            r.index = rule.index
            _must_succeed(lib.calrt_emu_add_rule(h, r), "calrt_emu_add_rule")

    # ---- the one call path ------------------------------------------------------------
    @property
    def _h(self) -> int:
        return self._dev.handle

    def _follow_clock(self) -> None:
        """A virtual device's time moves to the clock's (whoever advanced it)."""
        if self._virtual:
            self._lib.calrt_emu_advance_to(self._h, _ns(self.clock.now()))

    def _c(self, fn: str, *args: Any) -> int:
        """Call ``fn(device, *args)``; returns its CalRT code (and traces the call)."""
        self._follow_clock()
        rc = int(getattr(self._lib, fn)(self._h, *args))
        if self._trace is not None:
            self._trace.append((self.clock.now(), fn, args, rc))
        return rc

    def _sync_clock(self) -> None:
        if self._virtual:
            now = self._ffi.new("int64_t *")
            if self._lib.calrt_emu_now(self._h, now) == 0:
                self.clock.advance_to(now[0] / 1e9)  # type: ignore[attr-defined]

    def trace_lines(self) -> list[str]:
        """The calls so far as JSON lines (``trace=True``): time, function, integer
        arguments, code."""
        lines = []
        for t, fn, args, rc in list(self._trace or ()):
            shown = [a if isinstance(a, int | float | str) else
                     (a.decode() if isinstance(a, bytes) else type(a).__name__) for a in args]
            lines.append(json.dumps({"t": t, "call": fn, "args": shown, "rc": rc},
                                    separators=(",", ":")))
        return lines

    # ---- identity ---------------------------------------------------------------------
    def version(self) -> str:
        buf = self._ffi.new("char[]", 64)
        _must_succeed(self._lib.calrt_runtime_version(buf, 64), "calrt_runtime_version")
        return self._ffi.string(buf).decode()

    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def kv_capacity(self) -> int:
        return self._kv_capacity

    @property
    def is_emulator(self) -> bool:
        return self._emulator

    # ---- configuration ----------------------------------------------------------------
    def configure(self, calbin: Calbin) -> int:
        with self._lock:
            if self._closed:
                return _INVALID_STATE
            usable = isinstance(calbin, Calbin) and calbin.models
            if usable:
                # a calbin is built for one runtime: refused here, whatever the library
                # would do with it (the emulator reads the version and ignores it)
                rc = runtime_code(calbin.calrt_version, self.version())
                if rc:
                    return rc
            text = calbin_text(calbin) if usable else b"calfsm-calbin 1\nend\n"
            rc = self._c("calrt_configure", text, len(text))
            if rc == _OK:
                self._load_models()
            return rc

    def _load_models(self) -> None:
        ffi, lib, h = self._ffi, self._lib, self._h
        infos, models = [], {}
        mh = ffi.new("calrt_model_t *")
        mi = ffi.new("calrt_model_info_t *")
        ti = ffi.new("calrt_tensor_info_t *")
        csr = ffi.new("char[]", 256)
        # models by index until OUT_OF_RANGE: calrt_model_count is get_all_models' own call
        # (its fault point), not this one's
        for i in itertools.count():
            rc = lib.calrt_model_at(h, i, mh)
            if rc == _OUT_OF_RANGE:
                break
            _must_succeed(rc, "calrt_model_at", i)
            _must_succeed(lib.calrt_model_info(h, mh[0], mi), "calrt_model_info")
            tensors = []
            for k in range(mi.n_inputs + mi.n_outputs):
                _must_succeed(lib.calrt_model_tensor(h, mh[0], k, ti), "calrt_model_tensor")
                tensors.append(TensorInfo(
                    ffi.string(ti.name).decode(), tuple(ti.shape[j] for j in range(ti.ndim)),
                    DType(ffi.string(ti.dtype).decode()), int(ti.byte_size)))
            csrs = []
            for k in range(mi.n_csrs):
                _must_succeed(lib.calrt_model_csr(h, mh[0], k, csr, 256), "calrt_model_csr")
                csrs.append(ffi.string(csr).decode())
            info = ModelInfo(
                name=ffi.string(mi.name).decode(), kind=_KINDS.get(mi.kind),
                inputs=tuple(tensors[:mi.n_inputs]), outputs=tuple(tensors[mi.n_inputs:]),
                csr_names=tuple(csrs), tile_d0=None if mi.tile_d0 < 0 else int(mi.tile_d0))
            infos.append(info)
            models[info.name] = _Model(self, int(mh[0]), info, self._epoch)
        self._infos = tuple(infos)
        self._models = models
        self._configured = True

    def get_all_models(self) -> tuple[int, Sequence[ModelInfo] | None]:
        with self._lock:
            if self._closed:
                return _INVALID_STATE, None
            if not self._configured:
                return _MISSING_CONFIG, None
            n = self._ffi.new("uint32_t *")
            rc = self._c("calrt_model_count", n)
            if rc != _OK:
                return rc, None
            if n[0] != len(self._infos):  # pragma: no cover - library bug
                return _INVALID_STATE, None
            return _OK, self._infos

    def model(self, exact_name: str) -> tuple[int, _Model | None]:
        with self._lock:
            if self._closed:
                return _INVALID_STATE, None
            if not self._configured:
                return _MISSING_CONFIG, None
            out = self._ffi.new("calrt_model_t *")
            rc = self._c("calrt_model_lookup", _cname(exact_name), out)
            if rc != _OK:
                return rc, None
            m = self._models.get(exact_name)
            if m is None or m.handle != int(out[0]):  # pragma: no cover - library bug
                return _NOT_FOUND, None
            return _OK, m

    # ---- buffers ----------------------------------------------------------------------
    def create_buffers(self, model: _Model, engine: EngineSlot = EngineSlot.AUTO
                       ) -> tuple[int, tuple[_Buf, _Buf] | None]:
        with self._lock:
            if self._closed or not self._model_ok(model):
                return _INVALID_STATE, None
            eng = int(engine) if _is_int(engine) and int(engine) in (-1, 0, 1) else 99
            hi = self._ffi.new("calrt_buf_t *")
            ho = self._ffi.new("calrt_buf_t *")
            rc = self._c("calrt_create_buffers", model.handle, eng, hi, ho)
            if rc != _OK:
                return rc, None
            self._nbufs += 1
            k = self._nbufs
            bi = _Buf(self, model, int(hi[0]), True, f"in{k}")
            bo = _Buf(self, model, int(ho[0]), False, f"out{k}")
            for b in (bi, bo):
                b.finalizer = weakref.finalize(b, _release, self._dev, b.handle, b.maps)
            self._outs.add(bo)
            return _OK, (bi, bo)

    def destroy_buffers(self, inp: _Buf, out: _Buf) -> int:
        with self._lock:
            if self._closed or not self._buf_ok(inp) or not self._buf_ok(out):
                return _INVALID_STATE
            final = self._row_statuses(out)   # no job can be pending if it succeeds
            rc = self._c("calrt_destroy_buffers", inp.handle, out.handle)
            if rc == _OK:
                out.rows_final = final
                for b in (inp, out):
                    b.destroyed = True
                    if b.finalizer is not None:
                        b.finalizer.detach()
                    b.maps = {}
            return rc

    def map_buffer(self, buf: _Buf, tensor: str, host: np.ndarray) -> int:
        with self._lock:
            rc, info = self._tensor(buf, tensor)
            if rc:
                return rc
            assert info is not None
            dtype = info.dtype.value.encode()
            ptr = self._ffi.NULL
            nbytes = info.byte_size
            if not isinstance(host, np.ndarray) or host.dtype != np.dtype(info.dtype.host_dtype):
                dtype = b"?"
            elif not host.flags.c_contiguous:
                nbytes = _U64_MAX
            else:
                nbytes = host.nbytes
                if buf.is_input or host.flags.writeable:
                    ptr = self._ffi.cast("void *", host.ctypes.data)
            rc = self._c("calrt_map_buf", buf.handle, _cname(tensor), ptr, nbytes, dtype)
            if rc == _OK:
                buf.maps[tensor] = host   # alive and unmoved while the device may use it
                if not buf.is_input:
                    buf.status = OutputStatus.IDLE
            return rc

    def slice_tensor(self, buf: _Buf, tensor: str, offset: int, size: int) -> int:
        with self._lock:
            rc, _info = self._tensor(buf, tensor)
            if rc:
                return rc
            if not _is_int(offset) or not _is_int(size):
                return _INVALID_VALUE
            return self._c("calrt_slice_tensor", buf.handle, _cname(tensor),
                           _clamp(offset, -1, 2**62), _clamp(size, -1, 2**62))

    def undo_slice(self, buf: _Buf, tensor: str) -> int:
        with self._lock:
            rc, _info = self._tensor(buf, tensor)
            if rc:
                return rc
            return self._c("calrt_undo_slice", buf.handle, _cname(tensor))

    def set_csr(self, inp: _Buf, name: str, value: int, row: int = 0) -> int:
        with self._lock:
            if self._closed or not self._buf_ok(inp):
                return _INVALID_STATE
            if not inp.is_input:
                return _WRONG_DIRECTION
            if not isinstance(name, str) or name not in inp.model.info.csr_names:
                return _NOT_FOUND
            if not _is_int(value) or not 0 <= value <= _U32_MAX:
                return _INVALID_VALUE
            if not _is_int(row) or row < 0:
                return _INVALID_VALUE
            if row == 0:
                return self._c("calrt_set_csr", inp.handle, _cname(name), int(value))
            return self._c("calrt_set_csr_row", inp.handle, _cname(name), _row(row),
                           int(value))

    def set_kv_seq(self, inp: _Buf, seq_id: int, row: int = 0) -> int:
        with self._lock:
            if self._closed or not self._buf_ok(inp):
                return _INVALID_STATE
            if not inp.is_input:
                return _WRONG_DIRECTION
            if not _is_int(seq_id) or not 0 <= seq_id < _SEQ_LIMIT:
                return _INVALID_VALUE
            if not _is_int(row) or row < 0:
                return _INVALID_VALUE
            if row == 0:
                return self._c("calrt_set_kv_seq", inp.handle, int(seq_id))
            return self._c("calrt_set_kv_seq_row", inp.handle, _row(row), int(seq_id))

    def set_batch_rows(self, inp: _Buf, rows: int) -> int:
        """The rows of the next job of this input buffer (``docs/driver-protocol.md``,
        Batches): ``1 <= rows <= B``."""
        with self._lock:
            if self._closed or not self._buf_ok(inp):
                return _INVALID_STATE
            if not inp.is_input:
                return _WRONG_DIRECTION
            if not _is_int(rows):
                return _INVALID_VALUE
            # 0 for anything below 1: the library refuses it after its own checks
            return self._c("calrt_set_batch_rows", inp.handle, _clamp(rows, 0, _U32_MAX))

    # ---- execution --------------------------------------------------------------------
    def _handles(self, model: Any, inp: Any, out: Any) -> tuple[int, int, int]:
        """The library handles; 0 (refused by the library with INVALID_STATE at the point
        the protocol checks handles) for anything that is not this driver's."""
        mh = model.handle if isinstance(model, _Model) and model.driver is self else 0
        ih = inp.handle if isinstance(inp, _Buf) and inp.driver is self \
            and not inp.destroyed else 0
        oh = out.handle if isinstance(out, _Buf) and out.driver is self \
            and not out.destroyed else 0
        return mh, ih, oh

    def _tag(self, tag: JobTag | None) -> Any:
        if tag is None:
            return self._ffi.NULL
        t = self._ffi.new("calrt_job_tag_t *")
        t.job_id = _clamp(tag.job_id, _I64_MIN, _I64_MAX)
        t.seq_id = _clamp(tag.seq_id, -1, _I64_MAX)
        t.generation = _clamp(tag.generation, -_I64_MAX, _I64_MAX)
        return t

    def infer(self, model: _Model, inp: _Buf, out: _Buf, *, tag: JobTag | None = None) -> int:
        with self._lock:
            if self._closed:
                return _INVALID_STATE
            rc = self._c("calrt_infer", *self._handles(model, inp, out), self._tag(tag))
            if rc == _OK:
                out.status = OutputStatus.PENDING
            return rc

    def infer_fixed(self, model: _Model, inp: _Buf, out: _Buf, engine: EngineSlot, *,
                    tag: JobTag | None = None) -> int:
        with self._lock:
            if self._closed:
                return _INVALID_STATE
            eng = int(engine) if _is_int(engine) and int(engine) in (0, 1) else 99
            rc = self._c("calrt_infer_fixed", *self._handles(model, inp, out), eng,
                         self._tag(tag))
            if rc == _OK:
                out.status = OutputStatus.PENDING
            return rc

    def wait(self, out: _Buf, timeout_s: float) -> int:
        # not under the driver lock: a wait blocks (real time) and must not stop a reset,
        # a submit or a close from another thread; the library is thread-safe
        if self._closed or not self._buf_ok(out) or out.is_input:
            return _INVALID_STATE
        timeout = wait_timeout(timeout_s)
        if timeout is None:
            return _INVALID_VALUE
        ns = -1 if math.isinf(timeout) else min(round(timeout * 1e9), 2**62)
        with self._dev.lock:
            if self._dev.closed:
                return _INVALID_STATE
            handle = self._h
        if self._virtual:
            with self._lock:
                rc = self._c("calrt_wait", out.handle, ns)
                self._sync_clock()
                return rc
        rc = int(self._lib.calrt_wait(handle, out.handle, ns))
        if self._trace is not None:
            self._trace.append((self.clock.now(), "calrt_wait", (out.handle, ns), rc))
        return _INVALID_STATE if rc == _INVALID_STATE and self._closed else rc

    def status(self, out: _Buf) -> OutputStatus:
        if not isinstance(out, _Buf) or out.driver is not self or out.is_input:
            raise InvalidArgument(f"status() of {out!r}: not an output buffer of this driver",
                                  stage="status")
        with self._lock:
            if self._closed or out.destroyed:
                return out.status
            st = self._ffi.new("int32_t *")
            if self._c("calrt_get_status", out.handle, st) == _OK:
                out.status = OutputStatus(st[0])
            return out.status

    def row_status(self, out: _Buf, row: int) -> OutputStatus:
        """Row ``row``'s status of the buffer's last job (``docs/driver-protocol.md``,
        Batches): no code, as :meth:`status`; a row that is not one of the job's (padding,
        ``>= B``, negative, not an integer) is IDLE. Not an output buffer of this driver:
        :class:`~calfsm.errors.InvalidArgument`."""
        if not isinstance(out, _Buf) or out.driver is not self or out.is_input:
            raise InvalidArgument(f"row_status() of {out!r}: not an output buffer of this "
                                  "driver", stage="status")
        with self._lock:
            if not _is_int(row) or row < 0:
                return OutputStatus.IDLE
            if self._closed or out.destroyed:
                final = out.rows_final or ()
                return final[row] if row < len(final) else OutputStatus.IDLE
            st = self._ffi.new("int32_t *")
            if self._c("calrt_get_row_status", out.handle, _row(row), st) != _OK:
                return OutputStatus.IDLE    # pragma: no cover - the handle is this driver's
            return OutputStatus(st[0])

    def _row_statuses(self, out: _Buf) -> tuple[OutputStatus, ...]:
        """Every row's status as the library reports it now (B rows; raw calls, so a
        close or destroy does not trace them)."""
        self._follow_clock()
        st = self._ffi.new("int32_t *")
        rows = []
        for r in range(_batch(out.model.info)):
            rc = self._lib.calrt_get_row_status(self._h, out.handle, r, st)
            rows.append(OutputStatus(st[0]) if rc == _OK else out.status)
        return tuple(rows)

    def output_bytes(self, out: _Buf, tensor: str) -> tuple[int, int | None]:
        with self._lock:
            rc, _info = self._tensor(out, tensor)
            if rc:
                return rc, None
            n = self._ffi.new("uint64_t *")
            rc = self._c("calrt_output_bytes", out.handle, _cname(tensor), n)
            return (rc, None) if rc else (_OK, int(n[0]))

    def pending_jobs(self) -> int:
        """Jobs the device has not finished (ghosts of a reset included)."""
        with self._lock:
            if self._closed:
                return 0
            n = self._ffi.new("uint32_t *")
            _must_succeed(self._c("calrt_pending_jobs", n), "calrt_pending_jobs")
            if n[0] == 0:
                with self._dev.lock:
                    self._dev.parked.clear()
            return int(n[0])

    def timeline(self) -> list[PhaseSpan] | None:
        """The H2D, compute and D2H spans of the last ``timeline_jobs`` jobs that ended,
        oldest first, then of the jobs still pending (:mod:`calfsm.drivers.timeline`);
        None on a vendor library, whose device cannot report its phases."""
        with self._lock:
            if not self._emulator:
                return None
            if self._closed:
                return list(self._final_timeline or ())
            return [s for rec in self._timeline_records() for s in spans_of_job(*rec)]

    def _timeline_records(self) -> list[tuple]:
        """The emulator's records as :func:`spans_of_job` arguments."""
        if not self._timeline_jobs:
            return []
        cap = self._timeline_jobs + _MAX_PENDING
        recs = self._ffi.new("calrt_emu_job_record_t[]", cap)
        n = self._ffi.new("uint32_t *")
        _must_succeed(self._c("calrt_emu_timeline", recs, cap, n), "calrt_emu_timeline")
        out = []
        for r in recs[0:n[0]]:
            t = [_s(x) for x in r.phase_ns]
            tag = JobTag(r.tag.job_id, r.tag.seq_id, r.tag.generation) if r.has_tag else None
            out.append((int(r.job), int(r.engine), tag, OutputStatus(r.status),
                        ((t[0], t[1]), (t[2], t[3]), (t[4], t[5])), _s(r.ended_ns)))
        return out

    # ---- KV manager -------------------------------------------------------------------
    def kv_can_allocate(self, n: int) -> bool:
        with self._lock:
            if self._closed or not _is_int(n):
                return False
            ok = self._ffi.new("int32_t *")
            return self._c("calrt_kv_can_allocate", _clamp(n, 0, _U64_MAX), ok) == 0 \
                and bool(ok[0])

    def kv_apply(self, seq_id: int, target_len: int) -> bool:
        with self._lock:
            if self._closed or not _is_int(seq_id) or not _is_int(target_len) \
                    or not 0 <= seq_id < _SEQ_LIMIT or target_len < 0:
                return False
            ok = self._ffi.new("int32_t *")
            return self._c("calrt_kv_apply", int(seq_id), _clamp(target_len, 0, _U64_MAX),
                           ok) == 0 and bool(ok[0])

    def kv_release(self, seq_id: int, keep_len: int = 0) -> int:
        with self._lock:
            if self._closed:
                return _INVALID_STATE
            if not _is_int(seq_id) or not _is_int(keep_len) or keep_len < 0:
                return _INVALID_VALUE
            # a sequence outside int64 cannot exist: the library says 0 (after its faults)
            return self._c("calrt_kv_release", _clamp(seq_id, _I64_MIN, _I64_MAX),
                           _clamp(keep_len, 0, _U64_MAX))

    # ---- device control ---------------------------------------------------------------
    def reset(self, kind: ResetKind) -> int:
        with self._lock:
            if self._closed:
                return _INVALID_STATE
            try:
                kind = ResetKind(kind)
            except ValueError:
                return _INVALID_VALUE
            rc = self._c(_RESET_FN[kind])
            if rc == _OK and kind is not ResetKind.CCU:
                self._epoch += 1
                self._configured = False
                self._models = {}
                self._infos = ()
            return rc

    def enable_parallel_mode(self, enabled: bool) -> int:
        with self._lock:
            if self._closed:
                return _INVALID_STATE
            return self._c("calrt_enable_parallel_mode", int(bool(enabled)))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            st = self._ffi.new("int32_t *")
            for out in list(self._outs):   # statuses stay readable after close
                if not out.destroyed and self._lib.calrt_get_status(self._h, out.handle,
                                                                    st) == 0:
                    out.status = OutputStatus(st[0])
                if out.status is OutputStatus.PENDING:
                    out.status = OutputStatus.DONE_ABORTED
                if not out.destroyed:      # the close aborts what is pending
                    out.rows_final = tuple(
                        OutputStatus.DONE_ABORTED if s is OutputStatus.PENDING else s
                        for s in self._row_statuses(out))
            try:        # what ends at close stays readable; never a reason not to close
                records = self._timeline_records() if self._emulator else []
            except CalfsmError:
                records = []
            self._closed = True
            if self._trace is not None:
                self._trace.append((self.clock.now(), "calrt_device_close", (), 0))
            self._finalizer()   # closes the device: aborts jobs, joins its thread
            # what the close aborted ends now, as the device's own records would say
            now = self.clock.now()
            self._final_timeline = [
                s for job, eng, tag, st, phases, ended in records
                for s in spans_of_job(job, eng, tag, OutputStatus.DONE_ABORTED
                                      if st is OutputStatus.PENDING else st, phases,
                                      min(ended, now))]

    def __repr__(self) -> str:
        state = "closed" if self._closed else (
            "configured" if self._configured else "unconfigured")
        return f"<CalrtDriver {state} library={self.library_path!r}>"


def _trace_store(trace: bool | int) -> list[tuple] | deque[tuple] | None:
    """None (off), a list (``trace=True``: every call) or a ring of the last ``trace``."""
    if isinstance(trace, bool) or trace is None:
        return [] if trace else None
    if not isinstance(trace, int) or trace < 0:
        raise InvalidArgument(f"trace must be a bool or a number of records >= 0, got "
                              f"{trace!r}", stage="driver")
    return deque(maxlen=trace) if trace else None


def _s(ns: int) -> float:
    """Device nanoseconds as clock seconds (NEVER = INT64_MAX: never)."""
    return math.inf if ns >= _I64_MAX else ns / 1e9


def _ns(t: float) -> int:
    return _clamp(round(t * 1e9), 0, 2**62) if math.isfinite(t) else 2**62
