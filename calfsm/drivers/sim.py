"""SimDriver: a deterministic simulated Calculet NPU that behaves like the hardware.

Theory of operation
-------------------
The simulated device follows ``docs/driver-protocol.md`` rule by rule; the conformance
suite (:mod:`calfsm.testing.conformance`) checks it (and the native emulator) against that page.

*Jobs.* ``infer`` checks its arguments, then queues a job and computes its finish time
from the :class:`LatencyModel` and the pipeline state — nothing is read from host memory.
A job *executes* when device time reaches its finish time: every public call first runs
every job whose time has come (:meth:`SimDriver._pump`), in submission order. Executing
reads the mapped token and position arrays *at that moment*, checks CSRs, slices and the
KV allocation like the device would, and ends ``DONE_CCU_EXCEPTION`` (writing nothing)
when they disagree; otherwise it runs the hash chain against the sequence's KV words and
writes the whole output array (:mod:`calfsm.drivers.refmodel`).
In real time a fault-free job is computed a little before its finish time (by what
computing its graph and rows has cost this host, with a margin) and ends at that time:
the latency model is what the device costs, and a device computes during its step, so
the simulator's own arithmetic must not make the step longer than the model says.

*Time.* With a :class:`~calfsm.clock.VirtualClock` (the default) nothing sleeps: ``wait``
moves the clock to the job's finish (or by its timeout). With a
:class:`~calfsm.clock.RealClock` ``wait`` sleeps on a condition variable — releasing the
driver lock — so a reset or close from another thread wakes it. A timed sleep ends late
(measured on a small VM: 0.2-0.5 ms after a 10 ms sleep, counting the cold caches the
thread wakes to), which a real device's completion signal does not: the simulated device
would look idle for that long after every job. So the sleep ends ``wake_lead_s`` (0.5 ms)
before the finish time and the rest is polled with the lock released and the GIL yielded
on every turn; ``wake_lead_s=0`` restores a plain sleep.

*Faults.* A :class:`~calfsm.drivers.faults.FaultPlan` replaces the result of chosen calls
(see that module for the counting rules). Code effects return at the point where the
honest call would have succeeded; job effects are attached at submit and act at
execution (or at a reset, for ``stale``).

*Phases.* A job's H2D and D2H use the device's one DMA channel, its compute the one
compute unit; in parallel mode a job's transfers take the first free gap of the channel,
so they run while the other engine's job computes (``docs/driver-protocol.md``, Timing).
The planned phases are fixed at submit; a ring of the last ``timeline_jobs`` jobs that
ended feeds :meth:`SimDriver.timeline` (:mod:`calfsm.drivers.timeline`).

*Trace.* Off by default (a serving process would keep ~3 KB per job): ``trace=True``
records every call and every injected effect, ``trace=N`` only the last ``N`` records,
and a ``trace_path`` alone means everything, written at ``close``. A record is one JSON
line: virtual time in integer nanoseconds, the call, an argument summary (model names,
buffer labels such as ``in1``/``out1`` numbered in creation order, values) and the
result. No ids, addresses or wall-clock time, so a seed and a plan replay to the same
trace byte for byte. Records are kept as tuples and formatted only when
:meth:`SimDriver.trace_lines` is called.

Thread safety: one lock guards all state; the executor's submitter (``infer``) and
completion thread (``wait``) may call concurrently.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np

from calfsm.clock import Clock, VirtualClock
from calfsm.drivers import refmodel
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
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.timeline import DEFAULT_TIMELINE_JOBS, JobRing, PhaseSpan, spans_of_job
from calfsm.errors import CalrtCode, InvalidArgument
from calfsm.manifest import DType, Manifest, ModelInfo, TaskKind

__all__ = ["DEFAULT_CAPABILITIES", "SHAPE_COSTS", "LatencyModel", "SimDriver"]

_F = TypeVar("_F", bound=Callable[..., Any])

_OK = 0
_NOT_FOUND = int(CalrtCode.NOT_FOUND)
_INVALID_VALUE = int(CalrtCode.INVALID_VALUE)
_INVALID_STATE = int(CalrtCode.INVALID_STATE)
_ALREADY_CONFIGURED = int(CalrtCode.ALREADY_CONFIGURED)
_TIMEOUT = int(CalrtCode.TIMEOUT)
_OUT_OF_RANGE = int(CalrtCode.OUT_OF_RANGE)
_MISSING_CONFIG = int(CalrtCode.MISSING_CONFIG)
_DEVICE_BUSY = int(CalrtCode.DEVICE_BUSY)
_INVALID_CALBIN = int(CalrtCode.INVALID_CALBIN)
_DTYPE_MISMATCH = int(CalrtCode.DTYPE_MISMATCH)
_SHAPE_MISMATCH = int(CalrtCode.SHAPE_MISMATCH)
_UNSUPPORTED = int(CalrtCode.UNSUPPORTED)
_WRONG_DIRECTION = int(CalrtCode.WRONG_DIRECTION)

_BF16_NAN = 0x7FC0
_BF16_INF = 0x7F80

DEFAULT_CAPABILITIES = Capabilities(resets=frozenset(ResetKind), parallel_mode=True,
                                    fixed_engine_slots=True, engine_slots=2,
                                    batch_rows=True)


def _share(_inst: Any, attr: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, int | float) and 0.0 <= value < 1.0):
        raise InvalidArgument(f"LatencyModel.{attr.name} must be a number in [0, 1), got "
                              f"{value!r}", stage="driver")


def _seconds(_inst: Any, attr: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, int | float)
                                       and math.isfinite(value) and value >= 0):
        raise InvalidArgument(f"LatencyModel.{attr.name} must be a finite number >= 0, got "
                              f"{value!r}", stage="driver")


#: the two models of what a step's shape costs (:attr:`LatencyModel.shape_cost`): ``rows``
#: a dynamic-shape device (a step costs the rows it carries and their real lengths),
#: ``graph`` a static calbin (a step costs its graph's whole shape, padded rows included)
SHAPE_COSTS = ("rows", "graph")


def _shape_cost(_inst: Any, attr: attrs.Attribute, value: str) -> None:
    if value not in SHAPE_COSTS:
        raise InvalidArgument(f"LatencyModel.{attr.name} must be one of "
                              f"{', '.join(SHAPE_COSTS)}, got {value!r}", stage="driver")


#: the command lines' latency parameters: name -> (LatencyModel field, its unit in
#: seconds, or 1 for a share); ``shape_cost=rows|graph`` is the one word among them
LATENCY_PARAMS = {"decode_ms": ("decode_s", 1e-3),
                  "prefill_token_us": ("prefill_per_token_s", 1e-6),
                  "transfer_share": ("transfer_share", 1.0),
                  "batch_row_share": ("batch_row_share", 1.0),
                  "context_token_ns": ("context_token_s", 1e-9),
                  "shape_cost": ("shape_cost", 1.0)}


_SHARES = ("transfer_share", "batch_row_share")


@attrs.frozen
class LatencyModel:
    """How long a job's stages take on the simulated device.

    H2D moves the active input regions (bytes), compute costs per token (prefill) or per
    step (decode), D2H moves the whole output tensor (bytes). ``jitter`` (a fraction, 0
    by default) scales each job's stages by a factor in ``[1 - jitter, 1 + jitter]``
    derived from the driver seed and the job's ordinal (``fmix32``, no global RNG).

    ``transfer_share`` (0 by default: transfers cost their bytes) re-divides a job's time
    among its phases without changing it: of the total the three stages above give,
    ``transfer_share`` goes to the transfers (half H2D, half D2H) and the rest to compute.
    One job alone takes as long as before; two in flight on Ping and Pong can hide one's
    transfers behind the other's compute (``docs/driver-protocol.md``, Timing).

    ``batch_row_share`` prices the rows of a batch job: a decode step of ``rows`` rows
    computes ``decode_s * (1 + batch_row_share * (rows - 1))``; a prefill computes every
    row's tokens at ``prefill_per_token_s``. ``context_token_s`` (0 by default) adds, to a
    decode step, that much per context token a row attends over (its ``total_seq``).

    ``shape_cost`` says which rows and contexts a step pays for, two models of two kinds
    of device (``docs/driver-protocol.md``, Timing): ``"rows"`` (the default here) a
    dynamic-shape device, a step costs the rows it carries and their real contexts;
    ``"graph"`` a static calbin, a step costs its graph's whole shape: all ``max_batch``
    rows, padded ones included (a prefill: every row as long as its longest), and each
    row its graph's whole context window. The command lines, the soak and the
    benchmarks run ``"graph"`` unless told otherwise.
    """

    h2d_s_per_byte: float = 0.0
    prefill_per_token_s: float = 0.0
    decode_s: float = 0.0
    d2h_s_per_byte: float = 0.0
    jitter: float = 0.0
    transfer_share: float = attrs.field(default=0.0, validator=_share)
    #: a batch decode step of ``rows`` rows computes ``decode_s * (1 + batch_row_share *
    #: (rows - 1))``: a model of a decode bound by reading the weights once per step, not
    #: a measurement (``docs/driver-protocol.md``, Batches)
    batch_row_share: float = attrs.field(default=0.0, validator=_share)
    #: what each context token a decode row attends over adds to its step: a model of
    #: attention reading the KV, 0 by default (the step costs the weights alone)
    context_token_s: float = attrs.field(default=0.0, validator=_seconds)
    #: ``"rows"``: a step costs the rows it carries; ``"graph"``: its graph's whole shape
    shape_cost: str = attrs.field(default="rows", validator=_shape_cost)

    @classmethod
    def virtual_default(cls) -> LatencyModel:
        """Plausible figures: 16 GB/s DMA, 0.2 ms per prefill token, 10 ms per decode."""
        return cls(h2d_s_per_byte=1 / 16e9, prefill_per_token_s=2e-4, decode_s=0.010,
                   d2h_s_per_byte=1 / 16e9)

    @classmethod
    def zero(cls) -> LatencyModel:
        """Every job finishes the instant it is submitted."""
        return cls()

    @classmethod
    def fixed(cls, decode_s: float = 0.010, prefill_per_token_s: float = 0.0,
              h2d_s_per_byte: float = 0.0, d2h_s_per_byte: float = 0.0,
              jitter: float = 0.0, transfer_share: float = 0.0,
              batch_row_share: float = 0.0, context_token_s: float = 0.0,
              shape_cost: str = "rows") -> LatencyModel:
        """E.g. ``LatencyModel.fixed(decode_s=0.010, transfer_share=0.3)``: a 10 ms decode
        job of which 1.5 ms H2D, 7 ms compute, 1.5 ms D2H."""
        return cls(h2d_s_per_byte, prefill_per_token_s, decode_s, d2h_s_per_byte, jitter,
                   transfer_share, batch_row_share, context_token_s, shape_cost)

    def with_params(self, text: str, *, stage: str = "latency") -> LatencyModel:
        """This model with ``decode_ms=N,prefill_token_us=N,transfer_share=S`` (any of
        them, comma-separated) applied: the one parser of the command lines' latency
        option. A bad name or value is an InvalidArgument naming it."""
        changes: dict[str, Any] = {}
        for part in filter(None, text.split(",")):
            key, _, value_text = (s.strip() for s in part.partition("="))
            if key not in LATENCY_PARAMS:
                raise InvalidArgument(f"unknown parameter {key!r} (have "
                                      f"{', '.join(LATENCY_PARAMS)})", stage=stage)
            field, unit = LATENCY_PARAMS[key]
            if key == "shape_cost":
                if value_text not in SHAPE_COSTS:
                    raise InvalidArgument(f"shape_cost must be one of "
                                          f"{', '.join(SHAPE_COSTS)}, got {value_text!r}",
                                          stage=stage)
                changes[field] = value_text
                continue
            try:
                value = float(value_text)
            except ValueError:
                value = math.nan
            share = key in _SHARES
            if not math.isfinite(value) or value < 0 or (share and value >= 1):
                raise InvalidArgument(f"{key} must be a finite number >= 0"
                                      f"{' and < 1' if share else ''}, got {value_text!r}",
                                      stage=stage)
            changes[field] = value * unit
        return attrs.evolve(self, **changes)

    def compute_s(self, decode: bool, *, rows: int = 1, n_tokens: int = 0,
                  batch: int = 1, longest: int | None = None, context: int = 0,
                  window: int = 0) -> float:
        """Seconds of compute of one job: ``rows`` rows carried of its graph's ``batch``,
        ``n_tokens`` tokens of all rows (``longest``: of its longest row), ``context``
        the rows' contexts summed (their ``total_seq``), ``window`` the graph's context
        window; which of them it pays for is :attr:`shape_cost`."""
        if self.shape_cost == "graph":
            paid_rows = max(batch, rows)
            context = paid_rows * window
            n_tokens = paid_rows * (n_tokens if longest is None else longest)
        else:
            paid_rows = rows
        if decode:
            return self.decode_s * (1.0 + self.batch_row_share * (paid_rows - 1)) \
                + self.context_token_s * context
        return self.prefill_per_token_s * n_tokens

    def stages(self, decode: bool, n_tokens: int, h2d_bytes: int, d2h_bytes: int,
               factor: float = 1.0, rows: int = 1, *, batch: int = 1,
               longest: int | None = None, context: int = 0,
               window: int = 0) -> tuple[float, float, float]:
        """Seconds of (H2D, compute, D2H) of one job (``n_tokens``: of all its rows; the
        rest as :meth:`compute_s`)."""
        compute = self.compute_s(decode, rows=rows, n_tokens=n_tokens, batch=batch,
                                 longest=longest, context=context, window=window)
        h2d = h2d_bytes * self.h2d_s_per_byte * factor
        comp = compute * factor
        d2h = d2h_bytes * self.d2h_s_per_byte * factor
        share = self.transfer_share
        if share:
            total = h2d + comp + d2h
            h2d = d2h = total * share / 2
            comp = total * (1.0 - share)
        return h2d, comp, d2h


# ---------------------------------------------------------------------------------------
# handles


class _Model:
    """A configured model handle (``ModelHandle``)."""

    __slots__ = ("batch", "computable", "csr_cur", "csr_names", "csr_total", "decode", "driver",
                 "embeds", "epoch", "info", "input_names", "max_seq", "max_tokens", "name",
                 "out_name", "out_size", "pos_name", "pos_per_row", "row_bytes", "rows",
                 "tensors", "tok_name", "vocab")

    def __init__(self, driver: SimDriver, info: ModelInfo, epoch: int) -> None:
        self.driver = driver
        self.info = info
        self.name = info.name
        self.epoch = epoch
        self.tensors = tensor_table(info)
        self.input_names = tuple(t.name for t in info.inputs)
        tok, pos = info.inputs[0], info.inputs[1]
        out = info.outputs[0]
        self.tok_name, self.pos_name, self.out_name = tok.name, pos.name, out.name
        self.out_size = out.byte_size
        self.embeds = info.kind is TaskKind.PREFILL_EMBEDS
        # bytes of one token's input: an id, or an embedding row of shape[-1] values
        self.row_bytes = tok.dtype.itemsize * (tok.shape[-1] if self.embeds else 1)
        #: rows of one job (the batch dimension, docs/driver-protocol.md, Batches)
        self.batch = batch_of(info)
        #: tokens (and positions) of one row
        self.max_tokens = math.prod(tok.shape) * tok.dtype.itemsize // self.row_bytes \
            // self.batch
        self.pos_per_row = math.prod(pos.shape) // self.batch
        self.max_seq = 0    # set by configure: the calbin's largest prefill context
        self.vocab = out.shape[-1]
        self.decode = info.kind is TaskKind.DECODE
        self.rows = 1 if self.decode else (info.tile_d0 or 1)
        self.csr_cur, self.csr_total = info.csr_names[0], info.csr_names[1]
        self.csr_names = frozenset(info.csr_names)
        by_id = (info.kind in (TaskKind.DECODE, TaskKind.PREFILL_IDS)
                 and tok.dtype in (DType.S32, DType.U32))
        by_row = (self.embeds and len(tok.shape) >= 2
                  and tok.dtype in (DType.F32, DType.F16, DType.BF16))
        self.computable = ((by_id or by_row) and pos.dtype in (DType.S32, DType.U32)
                           and out.dtype in (DType.BF16, DType.U16))

    def __repr__(self) -> str:
        return f"<sim model {self.name!r}>"


class _Buf:
    """One input or output buffer of a model."""

    __slots__ = ("csrs", "destroyed", "driver", "engine", "epoch", "is_input", "job", "kv_seq",
                 "label", "last_job_id", "last_seq", "maps", "model", "out_bytes", "row_csrs",
                 "row_seqs", "row_status", "rows", "slices", "status", "submitted")

    def __init__(self, driver: SimDriver, model: _Model, is_input: bool, engine: int,
                 label: str) -> None:
        self.driver = driver
        self.model = model
        self.epoch = model.epoch
        self.is_input = is_input
        self.engine = engine
        self.label = label
        self.destroyed = False
        self.maps: dict[str, np.ndarray] = {}
        self.slices: dict[str, tuple[int, int]] = {}
        self.csrs: dict[str, int] = {}
        self.kv_seq: int | None = None
        #: input, batch graphs: rows of the next job, each row's KV sequence and CSRs (row
        #: 0's are also ``kv_seq`` and ``csrs``)
        self.rows = 1
        self.row_seqs: list[int | None] = [None] * model.batch
        self.row_csrs: list[dict[str, int]] = [self.csrs] + [{} for _ in range(1, model.batch)]
        #: output: each row's end in the last job (``row_status``)
        self.row_status: list[OutputStatus] = [OutputStatus.IDLE] * model.batch
        self.job: _Job | None = None
        self.status = OutputStatus.IDLE
        self.submitted = False
        self.out_bytes: int | None = None
        #: output: the KV sequence and tag job id of the last job submitted into it
        self.last_seq: int | None = None
        self.last_job_id: int | None = None

    def __repr__(self) -> str:
        return f"<sim buffer {self.label} of {self.model.name!r}>"


class _Job:
    __slots__ = ("computed", "effect", "engine", "finish", "ghost", "inp", "model", "ordinal",
                 "out", "phases", "rows", "rule", "rule_row", "seq", "seqs", "tag")

    def __init__(self, ordinal: int, model: _Model, inp: _Buf, out: _Buf,
                 tag: JobTag | None, engine: int, seq: int) -> None:
        self.ordinal = ordinal
        self.model = model
        self.inp = inp
        self.out = out
        self.tag = tag
        self.engine = engine
        self.seq = seq
        #: the rows the job carries and each row's KV sequence (row 0: ``seq``)
        self.rows = inp.rows if model.batch > 1 else 1
        self.seqs: tuple[int, ...] = tuple(inp.row_seqs[:self.rows])  # type: ignore[arg-type]
        #: the row a row-level effect (row_ccu_exception, nan, inf) hits (-1: none)
        self.rule_row = 0
        self.effect: str | None = None
        self.rule: FaultRule | None = None
        self.finish = 0.0
        self.ghost = False
        #: planned (start, end) of H2D, compute, D2H on the device clock
        self.phases: tuple[tuple[float, float], ...] = ()
        #: real time only: how the job ended when it was computed ahead of its finish
        #: time (``_finish``'s arguments), published when that time comes
        self.computed: tuple[OutputStatus, int, list[OutputStatus] | None] | None = None


# ---------------------------------------------------------------------------------------


def _traced(call: str, record: Callable[..., tuple]) -> Callable[[_F], _F]:
    """Make an implementation a protocol call: it runs under the driver lock, and when
    tracing, ``(call, record(*args, **kwargs), result)`` is appended to the trace.

    ``record`` takes the call's own arguments (same names and defaults) and returns the
    ``(field, value)`` pairs of its trace record; it runs only when tracing is on."""
    def wrap(impl: _F) -> _F:
        @functools.wraps(impl)
        def call_locked(self: SimDriver, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                rc = impl(self, *args, **kwargs)
                if self._trace is not None:
                    self._rec(call, record(*args, **kwargs), rc)
                return rc
        return call_locked  # type: ignore[return-value]
    return wrap


class SimDriver(ClosesOnExit, HandleChecks):
    """The simulated device. See the module docstring and ``docs/driver-protocol.md``."""

    name = "sim"
    _MODEL = _Model
    _BUF = _Buf

    def __init__(self, manifest_or_calbin: Manifest | Calbin | None = None, *, seed: int = 0,
                 faults: FaultPlan | None = None, clock: Clock | None = None,
                 latency: LatencyModel | None = None, kv_capacity: int = 1 << 20,
                 capabilities: Capabilities = DEFAULT_CAPABILITIES,
                 trace: bool | int = False, trace_path: str | Path | None = None,
                 wake_lead_s: float = 0.0005,
                 timeline_jobs: int = DEFAULT_TIMELINE_JOBS) -> None:
        if isinstance(manifest_or_calbin, Manifest):
            manifest_or_calbin = Calbin.from_manifest(manifest_or_calbin)
        if manifest_or_calbin is not None and not isinstance(manifest_or_calbin, Calbin):
            raise InvalidArgument(f"SimDriver takes a Manifest or a Calbin, got "
                                  f"{type(manifest_or_calbin).__name__}", stage="driver")
        if kv_capacity < 0:
            raise InvalidArgument(f"kv_capacity must be >= 0, got {kv_capacity}",
                                  stage="driver")
        if not 0 <= wake_lead_s <= 0.1:
            raise InvalidArgument(f"wake_lead_s must be in [0, 0.1] s, got {wake_lead_s}",
                                  stage="driver")
        #: real time only: how long before a job's finish ``wait`` stops sleeping and polls
        self.wake_lead_s = float(wake_lead_s)
        #: the calbin this device is meant to be configured with (the executor passes it
        #: to :meth:`configure`); any valid calbin is accepted
        self.calbin: Calbin | None = manifest_or_calbin
        self.seed = int(seed)
        self.faults = faults if faults is not None else FaultPlan.none()
        if not isinstance(self.faults, FaultPlan):
            raise InvalidArgument("faults must be a FaultPlan", stage="driver")
        self.clock: Clock = clock if clock is not None else VirtualClock()
        self.latency = latency if latency is not None else LatencyModel.virtual_default()
        self.kv_capacity = int(kv_capacity)
        self._caps = capabilities
        self._virtual = bool(getattr(self.clock, "virtual", False))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._epoch = 0
        self._configured: Calbin | None = None
        self._models: dict[str, _Model] = {}
        self._max_seq = 0
        self._parallel = False
        self._queue: list[_Job] = []
        #: real time: what computing a job costs this host, by (graph, rows), and the job
        #: being computed ahead of its finish time (its ``_finish`` is held back)
        self._compute_s: dict[tuple[str, int], float] = {}
        self._ahead: _Job | None = None
        self._ghosts: list[_Job] = []
        #: serial: when the device is free; parallel: the compute unit's and the last
        #: finish; the DMA channel's bookings (start, end), sorted
        self._comp_free = self._d2h_free = 0.0
        self._dma: list[tuple[float, float]] = []
        self._jobs = 0
        self._bufs = 0
        self._kv: dict[int, np.ndarray] = {}
        self._kv_alloc: dict[int, int] = {}
        self._kv_used = 0
        self._rules = self.faults.by_point()
        self._matches = [0] * len(self.faults.rules)
        self._fired = [0] * len(self.faults.rules)
        self._trace = _trace_store(trace, trace_path is not None)
        self._timeline = JobRing(timeline_jobs)
        self._trace_path = Path(trace_path) if trace_path is not None else None
        self._t0 = 0.0 if self._virtual else self.clock.now()
        if self._trace is not None:
            self._trace.append((0.0, "open", (
                ("seed", self.seed), ("faults", self.faults.name),
                ("rules", len(self.faults.rules)), ("kv_capacity", self.kv_capacity),
                ("virtual", self._virtual)), 0))

    # ---- trace ------------------------------------------------------------------------
    def _rec(self, call: str, args: tuple, rc: Any) -> None:
        self._trace.append((self.clock.now() - self._t0, call, args, rc))  # type: ignore[union-attr]

    def faults_fired(self) -> tuple[int, ...]:
        """How often each rule of the fault plan fired so far (cheap; no trace needed)."""
        with self._lock:
            return tuple(self._fired)

    def trace_lines(self) -> list[str]:
        """The trace so far, one JSON object per line (without newlines)."""
        with self._lock:
            records = list(self._trace or ())
        lines = []
        for t, call, args, rc in records:
            d: dict[str, Any] = {"t": round(t * 1e9), "call": call}
            for k, v in args:
                d[k] = v
            d["rc"] = rc if isinstance(rc, bool | str) else int(rc)
            lines.append(json.dumps(d, separators=(",", ":")))
        return lines

    def write_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text("".join(line + "\n" for line in self.trace_lines()), "utf-8")
        return path

    # ---- faults -----------------------------------------------------------------------
    def _fault(self, point: str, seq: int | None = None, job: int | None = None,
               name: str | None = None, row_seqs: tuple[int, ...] = ()) -> FaultRule | None:
        entries = self._rules.get(point)
        if not entries:
            return None
        chosen: FaultRule | None = None
        chosen_i = -1
        for i, r in entries:
            if r.seq_id is not None and r.seq_id != seq and r.seq_id not in row_seqs:
                continue
            if r.job_id is not None and r.job_id != job:
                continue
            if r.name is not None and r.name != name:
                continue
            self._matches[i] += 1
            if chosen is None and r.fires_at(self._matches[i], self._fired[i]):
                self._fired[i] += 1
                chosen, chosen_i = r, i
        if chosen is not None and self._trace is not None:
            args: tuple = (("point", point), ("effect", chosen.effect), ("rule", chosen_i))
            if chosen.effect == "code":
                args += (("code", chosen.effective_code),)
            self._rec("fault", args, 0)
        return chosen

    def _fault_code(self, point: str, **where: Any) -> int:
        """The code a ``code`` rule firing at ``point`` returns, else ``_OK``."""
        rule = self._fault(point, **where)
        return _OK if rule is None else rule.effective_code

    # ---- identity ---------------------------------------------------------------------
    def version(self) -> str:
        return "0.7.6"

    def capabilities(self) -> Capabilities:
        return self._caps

    # ---- configuration ----------------------------------------------------------------
    @_traced("configure", lambda calbin: (("models", _calbin_label(calbin)),))
    def configure(self, calbin: Calbin) -> int:
        if self._closed:
            return _INVALID_STATE
        self._pump()
        if self._configured is not None:
            return _ALREADY_CONFIGURED
        if not isinstance(calbin, Calbin) or not calbin.models or not _calbin_usable(calbin):
            return _INVALID_CALBIN
        rc = runtime_code(calbin.calrt_version, self.version()) \
            or self._fault_code("configure")
        if rc:
            return rc
        self._configured = calbin
        self._models = {m.name: _Model(self, m, self._epoch) for m in calbin.models}
        self._max_seq = max((mm.max_tokens for mm in self._models.values() if not mm.decode),
                            default=0)
        for mm in self._models.values():
            mm.max_seq = self._max_seq
        return _OK

    def _unconfigured(self) -> int:
        """INVALID_STATE once closed, MISSING_CONFIG before ``configure``, else 0: the
        first check of every call that needs the configured models."""
        if self._closed:
            return _INVALID_STATE
        return _MISSING_CONFIG if self._configured is None else _OK

    def get_all_models(self) -> tuple[int, Sequence[ModelInfo] | None]:
        with self._lock:
            rc = self._unconfigured() or self._fault_code("get_all_models")
            val = None if rc else tuple(self._configured.models)  # type: ignore[union-attr]
            if self._trace is not None:
                self._rec("get_all_models", (), rc)
            return rc, val

    def model(self, exact_name: str) -> tuple[int, _Model | None]:
        with self._lock:
            rc, val = self._unconfigured(), None
            if not rc:
                val = self._models.get(exact_name) if isinstance(exact_name, str) else None
                rc = self._fault_code("model", name=exact_name) if val is not None \
                    else _NOT_FOUND
                if rc:
                    val = None
            if self._trace is not None:
                self._rec("model", (("name", str(exact_name)),), rc)
            return rc, val

    # ---- buffers ----------------------------------------------------------------------
    def create_buffers(self, model: _Model, engine: EngineSlot = EngineSlot.AUTO
                       ) -> tuple[int, tuple[_Buf, _Buf] | None]:
        with self._lock:
            rc, val = self._create_buffers(model, engine)
            if self._trace is not None:
                args: tuple = (("model", getattr(model, "name", "?")), ("engine", int(engine)))
                if val is not None:
                    args += (("in", val[0].label), ("out", val[1].label))
                self._rec("create_buffers", args, rc)
            return rc, val

    def _create_buffers(self, model: _Model, engine: Any) -> tuple[int, Any]:
        if self._closed or not self._model_ok(model):
            return _INVALID_STATE, None
        try:
            engine = EngineSlot(engine)
        except ValueError:
            return _INVALID_VALUE, None
        if engine is not EngineSlot.AUTO and not self._caps.fixed_engine_slots:
            return _UNSUPPORTED, None
        rc = self._fault_code("create_buffers")
        if rc:
            return rc, None
        self._bufs += 1
        k = self._bufs
        return _OK, (_Buf(self, model, True, int(engine), f"in{k}"),
                     _Buf(self, model, False, int(engine), f"out{k}"))

    @_traced("destroy_buffers", lambda inp, out: (("in", _label(inp)), ("out", _label(out))))
    def destroy_buffers(self, inp: _Buf, out: _Buf) -> int:
        if self._closed or not self._buf_ok(inp) or not self._buf_ok(out):
            return _INVALID_STATE
        if not inp.is_input or out.is_input:
            return _WRONG_DIRECTION
        self._pump()
        if inp.job is not None or out.job is not None:
            return _DEVICE_BUSY
        rc = self._fault_code("destroy_buffers", seq=inp.kv_seq)
        if rc:
            return rc
        for b in (inp, out):
            b.destroyed = True
            b.maps = {}
        return _OK

    def _refused(self, buf: _Buf, call: str, **where: Any) -> int:
        """The last checks of a call that programs a buffer, in the runtime's order: jobs
        due by now complete first, a buffer the device holds is DEVICE_BUSY, then the fault
        plan may refuse the call (``where`` matches its rules). ``_OK``: go ahead."""
        self._pump()
        if buf.job is not None:
            return _DEVICE_BUSY
        return self._fault_code(call, **where)

    @_traced("map_buffer", lambda buf, tensor, host: (
        ("buf", _label(buf)), ("tensor", str(tensor)),
        ("nbytes", int(getattr(host, "nbytes", -1)))))
    def map_buffer(self, buf: _Buf, tensor: str, host: np.ndarray) -> int:
        rc, info = self._tensor(buf, tensor)
        if rc:
            return rc
        if not isinstance(host, np.ndarray) or host.dtype != np.dtype(info.dtype.host_dtype):
            return _DTYPE_MISMATCH
        if not host.flags.c_contiguous or host.nbytes != info.byte_size:
            return _SHAPE_MISMATCH
        if not buf.is_input and not host.flags.writeable:
            return _INVALID_VALUE
        rc = self._refused(buf, "map_buffer", seq=buf.kv_seq, name=tensor)
        if rc:
            return rc
        buf.maps[tensor] = host.reshape(-1)
        if not buf.is_input:
            buf.status = OutputStatus.IDLE
            buf.submitted = False
            buf.out_bytes = None
        return _OK

    @_traced("slice_tensor", lambda buf, tensor, offset, size: (
        ("buf", _label(buf)), ("tensor", str(tensor)), ("offset", _num(offset)),
        ("size", _num(size))))
    def slice_tensor(self, buf: _Buf, tensor: str, offset: int, size: int) -> int:
        rc, info = self._tensor(buf, tensor)
        if rc:
            return rc
        if not _is_int(offset) or not _is_int(size):
            return _INVALID_VALUE
        if size <= 0 or offset < 0 or offset + size > info.byte_size:
            return _OUT_OF_RANGE
        item = info.dtype.itemsize
        if offset % item or size % item:
            return _INVALID_VALUE
        rc = self._refused(buf, "slice_tensor", seq=buf.kv_seq, name=tensor)
        if rc:
            return rc
        buf.slices[tensor] = (int(offset), int(size))
        return _OK

    @_traced("undo_slice", lambda buf, tensor: (("buf", _label(buf)), ("tensor", str(tensor))))
    def undo_slice(self, buf: _Buf, tensor: str) -> int:
        rc, _info = self._tensor(buf, tensor)
        if rc:
            return rc
        rc = self._refused(buf, "undo_slice", seq=buf.kv_seq, name=tensor)
        if rc:
            return rc
        buf.slices.pop(tensor, None)
        return _OK

    @_traced("set_csr", lambda inp, name, value, row=0: (
        ("buf", _label(inp)), ("name", str(name)), ("value", _num(value)), *_row_arg(row)))
    def set_csr(self, inp: _Buf, name: str, value: int, row: int = 0) -> int:
        if self._closed or not self._buf_ok(inp):
            return _INVALID_STATE
        if not inp.is_input:
            return _WRONG_DIRECTION
        if row != 0 and not self._caps.batch_rows:
            return _UNSUPPORTED             # a device without the batch calls
        if name not in inp.model.csr_names:
            return _NOT_FOUND
        if not _is_int(value) or not 0 <= value <= _U32_MAX \
                or not _is_int(row) or not 0 <= row < inp.model.batch:
            return _INVALID_VALUE
        rc = self._refused(inp, "set_csr", seq=inp.kv_seq, name=name)
        if rc:
            return rc
        inp.row_csrs[int(row)][name] = int(value)
        return _OK

    @_traced("set_kv_seq", lambda inp, seq_id, row=0: (
        ("buf", _label(inp)), ("seq", _num(seq_id)), *_row_arg(row)))
    def set_kv_seq(self, inp: _Buf, seq_id: int, row: int = 0) -> int:
        if self._closed or not self._buf_ok(inp):
            return _INVALID_STATE
        if not inp.is_input:
            return _WRONG_DIRECTION
        if row != 0 and not self._caps.batch_rows:
            return _UNSUPPORTED
        if not _is_int(seq_id) or not 0 <= seq_id < _SEQ_LIMIT \
                or not _is_int(row) or not 0 <= row < inp.model.batch:
            return _INVALID_VALUE
        rc = self._refused(inp, "set_kv_seq", seq=int(seq_id))
        if rc:
            return rc
        inp.row_seqs[int(row)] = int(seq_id)
        if row == 0:
            inp.kv_seq = int(seq_id)
        return _OK

    @_traced("set_batch_rows", lambda inp, rows: (("buf", _label(inp)), ("rows", _num(rows))))
    def set_batch_rows(self, inp: _Buf, rows: int) -> int:
        if self._closed or not self._buf_ok(inp):
            return _INVALID_STATE
        if not inp.is_input:
            return _WRONG_DIRECTION
        if not self._caps.batch_rows:
            return _UNSUPPORTED
        if not _is_int(rows) or not 1 <= rows <= inp.model.batch:
            return _INVALID_VALUE
        rc = self._refused(inp, "set_batch_rows", seq=inp.kv_seq)
        if rc:
            return rc
        inp.rows = int(rows)
        return _OK

    # ---- execution --------------------------------------------------------------------
    @_traced("infer", lambda model, inp, out, *, tag=None: _infer_args(model, inp, out, tag,
                                                                       None))
    def infer(self, model: _Model, inp: _Buf, out: _Buf, *, tag: JobTag | None = None) -> int:
        return self._infer(model, inp, out, tag, None)

    def infer_fixed(self, model: _Model, inp: _Buf, out: _Buf, engine: EngineSlot, *,
                    tag: JobTag | None = None) -> int:
        with self._lock:
            if self._closed:
                rc = _INVALID_STATE
            elif not (self._caps.fixed_engine_slots and self._parallel):
                rc = _UNSUPPORTED
            elif not _is_int(engine) or int(engine) not in (EngineSlot.PING, EngineSlot.PONG):
                rc = _INVALID_VALUE
            else:
                rc = self._infer(model, inp, out, tag, int(engine))
            if self._trace is not None:
                self._rec("infer_fixed", _infer_args(model, inp, out, tag, engine), rc)
            return rc

    def _infer(self, model: _Model, inp: _Buf, out: _Buf, tag: JobTag | None,
               engine: int | None) -> int:
        rc = self._unconfigured()
        if rc:
            return rc
        if not (self._model_ok(model) and self._buf_ok(inp) and self._buf_ok(out)):
            return _INVALID_STATE
        if inp.model is not model or out.model is not model or not inp.is_input \
                or out.is_input:
            return _INVALID_VALUE
        if engine is not None and inp.engine not in (-1, engine):
            return _INVALID_VALUE
        maps = inp.maps
        for name in model.input_names:
            if name not in maps:
                return _MISSING_CONFIG
        if model.out_name not in out.maps or inp.kv_seq is None \
                or model.csr_cur not in inp.csrs or model.csr_total not in inp.csrs:
            return _MISSING_CONFIG
        rows = inp.rows if model.batch > 1 else 1
        if rows > 1:
            for r in range(1, rows):
                csrs = inp.row_csrs[r]
                if inp.row_seqs[r] is None or model.csr_cur not in csrs \
                        or model.csr_total not in csrs:
                    return _MISSING_CONFIG
            if len(set(inp.row_seqs[:rows])) < rows:
                return _INVALID_VALUE
        if model.batch > 1 and inp.slices:
            return _INVALID_VALUE
        self._pump()
        if out.job is not None or inp.job is not None:
            return _DEVICE_BUSY
        queue = self._queue
        if self._parallel:
            busy = {j.engine for j in queue}
            if len(queue) >= max(1, self._caps.engine_slots):
                return _DEVICE_BUSY
            if engine is None:
                engine = inp.engine if inp.engine >= 0 else (0 if 0 not in busy else 1)
            if engine in busy:
                return _DEVICE_BUSY
        else:
            if queue:
                return _DEVICE_BUSY
            engine = 0
        seq = tag.seq_id if tag is not None else inp.kv_seq
        row_seqs = tuple(inp.row_seqs[:rows]) if model.batch > 1 else ()
        rule = self._fault("infer", seq=seq, job=tag.job_id if tag is not None else None,
                           row_seqs=row_seqs)
        if rule is not None and rule.effect == "code":
            return rule.effective_code
        self._jobs += 1
        job = _Job(self._jobs, model, inp, out, tag, engine, inp.kv_seq)
        if rule is not None:
            job.effect = rule.effect
            job.rule = rule
            if rule.seq_id is not None:     # the row it names (none: the tag's seq)
                job.rule_row = job.seqs.index(rule.seq_id) if rule.seq_id in job.seqs \
                    else -1
        self._schedule(job)
        queue.append(job)
        inp.job = out.job = job
        out.status = OutputStatus.PENDING
        out.row_status = [OutputStatus.PENDING] * job.rows + \
            [OutputStatus.IDLE] * (model.batch - job.rows)
        out.submitted = True
        out.out_bytes = None
        out.last_seq = job.seq
        out.last_job_id = tag.job_id if tag is not None else None
        return _OK

    def _schedule(self, job: _Job) -> None:
        """Finish time of a new job from the latency model and the pipeline state."""
        inp, model = job.inp, job.model
        if model.batch > 1:     # each row's own prefix of tokens and positions
            curs = [inp.row_csrs[r][model.csr_cur] for r in range(job.rows)]
            n_tokens = sum(curs)
            longest = max(curs, default=0)
            pos_item = inp.maps[model.pos_name].itemsize
            h2d_bytes = n_tokens * (model.row_bytes + pos_item)
        else:
            h2d_bytes = 0
            for name in model.input_names:
                region = inp.slices.get(name)
                h2d_bytes += region[1] if region is not None else inp.maps[name].nbytes
            tok = inp.slices.get(model.tok_name)
            n_tokens = (tok[1] if tok is not None else inp.maps[model.tok_name].nbytes) // 4
            longest = n_tokens
        context = sum(inp.row_csrs[r].get(model.csr_total, 0) for r in range(job.rows))
        lat = self.latency
        factor = 1.0
        if lat.jitter:
            u = refmodel.fmix32(self.seed ^ (job.ordinal * refmodel.TOKEN_MUL))
            factor = 1.0 + lat.jitter * (2.0 * u / 2**32 - 1.0)
        h2d, comp, d2h = lat.stages(model.decode, n_tokens, h2d_bytes, model.out_size, factor,
                                    job.rows, batch=model.batch, longest=longest,
                                    context=context, window=model.max_seq)
        now = self.clock.now()
        if job.effect == "hang":
            comp = math.inf
        if self._parallel:
            # one DMA channel (H2D and D2H) and one compute unit, each taken in turn: this
            # job's transfers use the channel while the other engine's job computes
            h2d_start = self._book_dma(now, h2d)
            comp_start = max(h2d_start + h2d, self._comp_free)
            comp_end = comp_start + comp
            self._comp_free = comp_end
            d2h_start = self._book_dma(comp_end, d2h)
            finish = d2h_start + d2h
            self._d2h_free = max(self._d2h_free, finish)
        else:
            h2d_start = max(now, self._d2h_free)
            comp_start = h2d_start + h2d
            comp_end = comp_start + comp
            d2h_start = comp_end
            finish = d2h_start + d2h
            self._comp_free = self._d2h_free = finish
        job.finish = finish
        job.phases = ((h2d_start, h2d_start + h2d), (comp_start, comp_end), (d2h_start, finish))

    def _book_dma(self, earliest: float, length: float) -> float:
        """Book ``length`` seconds of the DMA channel in its first free gap at or after
        ``earliest``; returns the start. Bookings that ended by now are dropped."""
        now = self.clock.now()
        booked = [b for b in self._dma if b[1] > now]
        t = earliest
        for start, end in booked:          # sorted by start, never overlapping
            if end <= t:
                continue
            if start >= t + length:
                break
            t = end
        booked.append((t, t + length))
        booked.sort()
        self._dma = booked
        return t

    def _pump(self) -> None:
        """Execute every job (queued or stale) whose finish time has come, in order."""
        queue, ghosts = self._queue, self._ghosts
        if not queue and not ghosts:
            return
        now = self.clock.now()
        while True:
            job = queue[0] if queue and queue[0].finish <= now else None
            for g in ghosts:
                if g.finish <= now and (job is None or g.finish < job.finish):
                    job = g
            if job is None:
                return
            if job.ghost:
                ghosts.remove(job)
            else:
                queue.pop(0)
            if job.computed is not None:
                self._finish(job, *job.computed)
            else:
                self._execute(job)

    def _finish(self, job: _Job, status: OutputStatus, nbytes: int,
                rows: list[OutputStatus] | None = None) -> None:
        """End ``job`` with ``status``; ``rows``: each row's end when it ran (DONE_OK),
        else every row ends as the job did."""
        if job is self._ahead:          # computed ahead: ends at its finish time
            job.computed = (status, nbytes, rows)
            return
        out, inp = job.out, job.inp
        if out.job is job:
            out.job = None
            out.status = status
            out.out_bytes = nbytes
            out.row_status = (rows or [status] * job.rows) + \
                [OutputStatus.IDLE] * (job.model.batch - job.rows)
        if inp.job is job:
            inp.job = None
        if self._timeline.enabled:
            ended = job.finish if status is not OutputStatus.DONE_ABORTED \
                else min(job.finish, self.clock.now())
            self._timeline.add(job.ordinal, job.engine, job.tag, status, job.phases, ended)
        if self._trace is not None:
            self._rec("exec", (("job", job.ordinal), ("out", out.label),
                               ("status", status.name), ("bytes", nbytes)), int(status))
        self._cond.notify_all()

    def _execute(self, job: _Job) -> None:
        if self._virtual:
            self._compute(job)
            return
        t0 = time.perf_counter()
        self._compute(job)
        key = (job.model.name, job.rows)
        spent = time.perf_counter() - t0
        known = self._compute_s.get(key)
        self._compute_s[key] = spent if known is None else 0.8 * known + 0.2 * spent

    def _compute(self, job: _Job) -> None:
        model, inp, out = job.model, job.inp, job.out
        if model.batch > 1 and job.effect != "ccu_exception" and model.computable:
            self._execute_rows(job)
            return
        if job.effect in ("ccu_exception", "row_ccu_exception") or not model.computable:
            self._finish(job, OutputStatus.DONE_CCU_EXCEPTION, 0)
            return
        tok_arr, pos_arr = inp.maps[model.tok_name], inp.maps[model.pos_name]
        tok_region = inp.slices.get(model.tok_name)
        pos_region = inp.slices.get(model.pos_name)
        if model.embeds:    # one word per embedding row (reference-model.md)
            raw = tok_arr.view(np.uint8)
            if tok_region is not None:
                raw = raw[tok_region[0]:tok_region[0] + tok_region[1]]
            if len(raw) % model.row_bytes:
                self._finish(job, OutputStatus.DONE_CCU_EXCEPTION, 0)
                return
            tokens = refmodel.embed_words(raw.reshape(-1, model.row_bytes))
        elif tok_region is None:
            tokens = tok_arr
        else:
            tokens = tok_arr[tok_region[0] // 4:(tok_region[0] + tok_region[1]) // 4]
        positions = pos_arr if pos_region is None else \
            pos_arr[pos_region[0] // 4:(pos_region[0] + pos_region[1]) // 4]
        n = len(tokens)
        if not self._row_ok(job, model, job.seq, n, positions, inp.csrs):
            self._finish(job, OutputStatus.DONE_CCU_EXCEPTION, 0)
            return
        hashes = self._row_hashes(job, job.seq, tokens, positions)
        dest = out.maps[model.out_name]
        effect = job.effect
        nbytes = model.out_size
        if effect == "short_output":
            scratch = np.empty_like(dest)
            self._write_logits(model, hashes, scratch)
            rule = job.rule
            nbytes = model.out_size // 2 if rule is None or rule.n_bytes is None \
                else min(rule.n_bytes, model.out_size)
            dest.view(np.uint8)[:nbytes] = scratch.view(np.uint8)[:nbytes]
        else:
            self._write_logits(model, hashes, dest)
            if effect in ("nan", "inf"):
                row = refmodel.tile_row(n, model.rows) if not model.decode else 0
                index = (job.rule.index if job.rule is not None else 0) % model.vocab
                dest[row * model.vocab + index] = _BF16_NAN if effect == "nan" else _BF16_INF
        self._finish(job, OutputStatus.DONE_OK, nbytes)

    def _execute_rows(self, job: _Job) -> None:
        """A job of a batch graph: every row on its own (docs/driver-protocol.md, Batches).
        Row ``r`` reads the first ``cur_seq[r]`` tokens and positions of its row, is
        checked as a single-row job is, and writes its own KV and logits ``[r, ...]``; a
        row that fails writes nothing. Padding rows' logits are zero."""
        model, inp, out = job.model, job.inp, job.out
        tok_arr, pos_arr = inp.maps[model.tok_name], inp.maps[model.pos_name]
        target = out.maps[model.out_name]
        short = job.effect == "short_output"
        dest = np.empty_like(target) if short else target
        per_out = model.rows * model.vocab
        width = model.max_tokens
        raw = tok_arr.view(np.uint8) if model.embeds else None
        ends: list[OutputStatus] = []
        for r in range(job.rows):
            row_dest = dest[r * per_out:(r + 1) * per_out]
            csrs = inp.row_csrs[r]
            n = csrs[model.csr_cur]
            failed = job.effect == "row_ccu_exception" and r == job.rule_row
            if not failed and 1 <= n <= width:
                if raw is not None:
                    start = r * width * model.row_bytes
                    tokens = refmodel.embed_words(
                        raw[start:start + n * model.row_bytes].reshape(-1, model.row_bytes))
                else:
                    tokens = tok_arr[r * width:r * width + n]
                positions = pos_arr[r * model.pos_per_row:r * model.pos_per_row + n]
                failed = not self._row_ok(job, model, job.seqs[r], n, positions, csrs)
            else:
                failed = True
            if failed:
                row_dest[:] = 0
                ends.append(OutputStatus.DONE_CCU_EXCEPTION)
                continue
            seq = job.seqs[r]
            hashes = self._row_hashes(job, seq, tokens, positions)
            self._write_logits(model, hashes, row_dest)
            if job.effect in ("nan", "inf") and r == job.rule_row:
                at = refmodel.tile_row(n, model.rows) if not model.decode else 0
                index = (job.rule.index if job.rule is not None else 0) % model.vocab
                row_dest[at * model.vocab + index] = \
                    _BF16_NAN if job.effect == "nan" else _BF16_INF
            ends.append(OutputStatus.DONE_OK)
        dest[job.rows * per_out:] = 0
        nbytes = model.out_size
        if short:
            rule = job.rule
            nbytes = model.out_size // 2 if rule is None or rule.n_bytes is None \
                else min(rule.n_bytes, model.out_size)
            target.view(np.uint8)[:nbytes] = dest.view(np.uint8)[:nbytes]
        self._finish(job, OutputStatus.DONE_OK, nbytes, ends)

    def _row_ok(self, job: _Job, model: _Model, seq: int, n: int, positions: np.ndarray,
                csrs: dict[str, int]) -> bool:
        """The device's checks of one row (or a single-row job) before it computes."""
        if n < 1 or len(positions) != n or csrs[model.csr_cur] != n:
            return False
        last = int(positions[n - 1])
        if csrs[model.csr_total] != last + 1 or (model.decode and n != 1):
            return False
        lo, hi = (last, last) if n == 1 else (int(positions.min()), int(positions.max()))
        max_seq = model.max_seq
        if job.ghost:   # a stale completion: no allocation check (its KV is not its own)
            return lo >= 0 and (not max_seq or hi < max_seq)
        alloc = self._kv_alloc.get(seq, 0)
        return lo >= 0 and hi < (min(alloc, max_seq) if max_seq else alloc)

    def _row_hashes(self, job: _Job, seq: int, tokens: np.ndarray,
                    positions: np.ndarray) -> list[int]:
        """The hash chain of one row; a stale completion reads KV and writes none."""
        if job.ghost:
            hi = int(positions.max())
            kv = np.zeros(hi + 1, np.uint32)
            have = self._kv.get(seq)
            if have is not None:
                m = min(len(have), hi + 1)
                kv[:m] = have[:m]
            return refmodel.chain_into(kv, tokens, positions, write=False)
        return refmodel.chain_into(self._kv[seq], tokens, positions)

    @staticmethod
    def _write_logits(model: _Model, hashes: list[int], dest: np.ndarray) -> None:
        if model.decode:
            refmodel.kernel(model.vocab).into(hashes[-1], dest[:model.vocab])
            if len(dest) > model.vocab:
                dest[model.vocab:] = 0
        else:
            refmodel.prefill_tile(hashes, model.rows, dest[:model.rows * model.vocab])

    def _compute_at(self, job: _Job) -> float:
        """Real time: when the waiting thread computes ``job`` (inf: never ahead). The
        modelled time is what the device costs; computing the reference model is this
        host's cost, which a device does during its step, not after it. So a fault-free
        job at the head of the queue is computed just before its finish time (by the
        cost measured for its graph and rows, with a margin) and ends at that time."""
        if job.computed is not None or job.effect is not None or job.ghost \
                or not self._queue or self._queue[0] is not job or math.isinf(job.finish):
            return math.inf
        cost = self._compute_s.get((job.model.name, job.rows))
        return job.finish - (2 * cost + 1e-4 if cost is not None else 0.0)

    def _compute_ahead(self, job: _Job) -> None:
        self._ahead = job
        try:
            self._execute(job)
        finally:
            self._ahead = None

    @_traced("wait", lambda out, timeout_s: (("out", _label(out)), ("timeout", _num(timeout_s))))
    def wait(self, out: _Buf, timeout_s: float) -> int:
        if self._closed or not self._buf_ok(out) or out.is_input:
            return _INVALID_STATE
        timeout = wait_timeout(timeout_s)
        if timeout is None:             # checked before the job, as CalrtDriver does
            return _INVALID_VALUE
        self._pump()
        if not out.submitted:
            return _INVALID_STATE
        job = out.job
        if job is None:
            return _OK
        rc = self._fault_code("wait", seq=job.seq,
                              job=job.tag.job_id if job.tag is not None else None)
        if rc:
            return rc
        clock = self.clock
        if self._virtual:
            deadline = clock.now() + timeout
            if job.finish <= deadline and math.isfinite(job.finish):   # a hang never ends
                clock.advance_to(job.finish)  # type: ignore[attr-defined]
                self._pump()
                return _OK
            if math.isfinite(deadline):
                clock.advance_to(deadline)  # type: ignore[attr-defined]
                self._pump()
            return _TIMEOUT if out.job is job else _OK
        deadline = clock.now() + timeout
        lead = self.wake_lead_s
        while out.job is job:
            now = clock.now()
            if job.finish <= now:
                self._pump()
                continue
            if now >= deadline:
                return _TIMEOUT
            ahead = self._compute_at(job)
            if now >= ahead:
                self._compute_ahead(job)
                continue
            until = min(job.finish, deadline)
            if min(until - lead, ahead) > now:
                # releases the lock; a reset or close wakes it (a hang with no limit:
                # only they do, and Condition.wait takes no infinite timeout)
                wake = min(until - lead, ahead)
                self._cond.wait(None if math.isinf(wake) else wake - now)
                continue
            self._lock.release()        # the last stretch: poll, lock free, GIL yielded
            try:
                while clock.now() < until and out.job is job:
                    time.sleep(0)
            finally:
                self._lock.acquire()
        return _OK

    def status(self, out: _Buf) -> OutputStatus:
        with self._lock:
            if not isinstance(out, _Buf) or out.driver is not self or out.is_input:
                raise InvalidArgument(f"status() of {out!r}: not an output buffer of this "
                                      "driver", stage="status")
            if not self._closed:
                self._pump()
            st = out.status
            if self._trace is not None:
                self._rec("status", (("out", out.label),), st.name)
            return st

    def row_status(self, out: _Buf, row: int) -> OutputStatus:
        """How row ``row`` of the last job ended (docs/driver-protocol.md, Batches)."""
        with self._lock:
            if not isinstance(out, _Buf) or out.driver is not self or out.is_input:
                raise InvalidArgument(f"row_status() of {out!r}: not an output buffer of "
                                      "this driver", stage="status")
            if not self._closed:
                self._pump()
            st = out.row_status[int(row)] if _is_int(row) and 0 <= row < len(out.row_status) \
                else OutputStatus.IDLE
            if not out.submitted:
                st = OutputStatus.IDLE
            if self._trace is not None:
                self._rec("row_status", (("out", out.label), ("row", _num(row))), st.name)
            return st

    def output_bytes(self, out: _Buf, tensor: str) -> tuple[int, int | None]:
        with self._lock:
            rc, val = self._output_bytes(out, tensor)
            if self._trace is not None:
                self._rec("output_bytes", (("out", _label(out)), ("tensor", str(tensor)),
                                           ("bytes", val)), rc)
            return rc, val

    def _output_bytes(self, out: _Buf, tensor: str) -> tuple[int, int | None]:
        rc, _info = self._tensor(out, tensor)
        if rc:
            return rc, None
        self._pump()
        if out.job is not None or out.out_bytes is None:
            return _INVALID_STATE, None
        rc = self._fault_code("output_bytes", seq=out.last_seq, job=out.last_job_id,
                              name=tensor)
        return (rc, None) if rc else (_OK, out.out_bytes)

    # ---- KV manager -------------------------------------------------------------------
    def kv_can_allocate(self, n: int) -> bool:
        with self._lock:
            ok = (not self._closed and _is_int(n)
                  and self.kv_capacity - self._kv_used >= n)
            if ok and self._fault("kv_can_allocate") is not None:
                ok = False
            if self._trace is not None:
                self._rec("kv_can_allocate", (("n", _num(n)),), ok)
            return ok

    @_traced("kv_apply", lambda seq_id, target_len: (("seq", _num(seq_id)),
                                                    ("target", _num(target_len))))
    def kv_apply(self, seq_id: int, target_len: int) -> bool:
        if self._closed or not _is_int(seq_id) or not _is_int(target_len) \
                or not 0 <= seq_id < _SEQ_LIMIT or target_len < 0:
            return False
        cur = self._kv_alloc.get(seq_id, 0)
        need = target_len - cur
        if need > self.kv_capacity - self._kv_used:
            return False
        if self._fault("kv_apply", seq=int(seq_id)) is not None:
            return False
        if need <= 0:
            return True
        words = self._kv.get(seq_id)
        if words is None or len(words) < target_len:
            grown = np.zeros(max(target_len, 2 * len(words) if words is not None else 0, 16),
                             np.uint32)
            if words is not None:
                grown[:len(words)] = words
            self._kv[seq_id] = grown
        self._kv_alloc[seq_id] = int(target_len)
        self._kv_used += need
        return True

    @_traced("kv_release", lambda seq_id, keep_len=0: (("seq", _num(seq_id)),
                                                      ("keep", _num(keep_len))))
    def kv_release(self, seq_id: int, keep_len: int = 0) -> int:
        if self._closed:
            return _INVALID_STATE
        if not _is_int(seq_id) or not _is_int(keep_len) or keep_len < 0:
            return _INVALID_VALUE
        rc = self._fault_code("kv_release", seq=int(seq_id))
        if rc:
            return rc
        cur = self._kv_alloc.get(seq_id)
        if cur is None or keep_len >= cur:
            return _OK
        self._kv[seq_id][keep_len:cur] = 0
        self._kv_used -= cur - keep_len
        if keep_len == 0:
            del self._kv_alloc[seq_id]
            del self._kv[seq_id]
        else:
            self._kv_alloc[seq_id] = int(keep_len)
        return _OK

    def kv_allocated(self, seq_id: int) -> int:
        """Positions allocated to ``seq_id`` (a test and diagnostics helper, not protocol)."""
        with self._lock:
            return self._kv_alloc.get(seq_id, 0)

    # ---- device control ---------------------------------------------------------------
    @_traced("reset", lambda kind: (("kind", str(getattr(kind, "value", kind))),))
    def reset(self, kind: ResetKind) -> int:
        if self._closed:
            return _INVALID_STATE
        try:
            kind = ResetKind(kind)
        except ValueError:
            return _INVALID_VALUE
        if not self._caps.can_reset(kind):
            return _UNSUPPORTED
        self._pump()
        rc = self._fault_code("reset")
        if rc:
            return rc
        self._abort_pending(keep_stale=True)
        self._parallel = False      # every reset kind: the host enables it again
        if kind in (ResetKind.CONFIGURATION, ResetKind.FULL):
            self._epoch += 1
            self._configured = None
            self._models = {}
            self._max_seq = 0
        if kind is ResetKind.FULL:
            self._kv.clear()
            self._kv_alloc.clear()
            self._kv_used = 0
        return _OK

    def _abort_pending(self, keep_stale: bool) -> None:
        queue, self._queue = self._queue, []
        for job in queue:
            if keep_stale and job.effect == "stale":
                job.ghost = True
                self._ghosts.append(job)
            else:
                self._finish(job, OutputStatus.DONE_ABORTED, 0)
        if not keep_stale:
            ghosts, self._ghosts = self._ghosts, []
            for job in ghosts:
                self._finish(job, OutputStatus.DONE_ABORTED, 0)
        now = self.clock.now()
        self._comp_free = self._d2h_free = now
        self._dma = []
        self._cond.notify_all()

    @_traced("enable_parallel_mode", lambda enabled: (("on", bool(enabled)),))
    def enable_parallel_mode(self, enabled: bool) -> int:
        if self._closed:
            return _INVALID_STATE
        if not self._caps.parallel_mode:
            return _UNSUPPORTED
        self._pump()
        if self._queue:
            return _DEVICE_BUSY
        rc = self._fault_code("enable_parallel_mode")
        if rc:
            return rc
        self._parallel = bool(enabled)
        return _OK

    @property
    def parallel_mode(self) -> bool:
        return self._parallel

    def timeline(self) -> list[PhaseSpan]:
        """The H2D, compute and D2H spans of the last ``timeline_jobs`` jobs that ended
        (executed or aborted), oldest first, then the planned spans of the jobs still
        pending (status PENDING) in submission order (:mod:`calfsm.drivers.timeline`)."""
        with self._lock:
            if not self._closed:
                self._pump()
            spans = self._timeline.spans()
            if self._timeline.enabled:
                for job in sorted((*self._queue, *self._ghosts), key=lambda j: j.ordinal):
                    spans.extend(spans_of_job(job.ordinal, job.engine, job.tag,
                                              OutputStatus.PENDING, job.phases, math.inf))
            return spans

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._pump()
            self._abort_pending(keep_stale=False)
            self._closed = True
            if self._trace is not None:
                self._rec("close", (), 0)
            self._cond.notify_all()
        if self._trace_path is not None:
            self.write_trace(self._trace_path)

    def __repr__(self) -> str:
        state = "closed" if self._closed else (
            "configured" if self._configured is not None else "unconfigured")
        return f"<SimDriver {state} seed={self.seed} faults={self.faults.describe()!r}>"


# ---------------------------------------------------------------------------------------


def _calbin_usable(calbin: Calbin) -> bool:
    """Structural checks a device makes when it loads a calbin."""
    names = set()
    for m in calbin.models:
        if not isinstance(m, ModelInfo) or not m.name or m.name in names:
            return False
        names.add(m.name)
        if len(m.inputs) < 2 or len(m.outputs) < 1 or len(m.csr_names) < 2:
            return False
        for t in (*m.inputs, *m.outputs):
            if not t.shape or any(d <= 0 for d in t.shape) \
                    or t.byte_size != math.prod(t.shape) * t.dtype.itemsize:
                return False
        out = m.outputs[0]
        batch = batch_of(m)
        if batch > 1 and any(len(t.shape) < 2 or t.shape[0] != batch
                             for t in (*m.inputs, *m.outputs)):
            return False
        if m.kind is not None and m.kind.is_prefill:
            d0 = m.tile_d0
            if not d0 or d0 <= 0 or math.prod(out.shape) != batch * d0 * out.shape[-1]:
                return False
    return True



def _trace_store(trace: bool | int, to_file: bool) -> list[tuple] | deque[tuple] | None:
    """Where trace records go: None (off), a list (everything) or a ring of the last
    ``trace`` records. A ``trace_path`` without a ring asks for everything."""
    if isinstance(trace, bool) or trace is None:
        return [] if trace or to_file else None
    if not isinstance(trace, int) or trace < 0:
        raise InvalidArgument(f"trace must be a bool or a number of records >= 0, got "
                              f"{trace!r}", stage="driver")
    if trace == 0:
        return [] if to_file else None
    return deque(maxlen=trace)


def _calbin_label(calbin: Any) -> str:
    if isinstance(calbin, Calbin):
        return ",".join(m.name for m in calbin.models)
    return type(calbin).__name__


def _num(x: Any) -> Any:
    if isinstance(x, bool):
        return x
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else str(x)
    return repr(type(x).__name__)


def _row_arg(row: Any) -> tuple:
    """A trace record's row field: only for a row other than 0."""
    return () if isinstance(row, int) and not isinstance(row, bool) and row == 0 \
        else (("row", _num(row)),)


def batch_of(info: ModelInfo) -> int:
    """A calbin model's batch size: the first dimension of its token tensor when that has
    a batch dimension (``[B, n]`` ids, ``[B, n, hidden]`` embeddings), else 1."""
    tok = info.inputs[0].shape if info.inputs else ()
    embeds = info.kind is TaskKind.PREFILL_EMBEDS
    return tok[0] if len(tok) >= (3 if embeds else 2) and tok[0] > 0 else 1


def _label(b: Any) -> str:
    return b.label if isinstance(b, _Buf) else "?"


def _infer_args(model: Any, inp: Any, out: Any, tag: JobTag | None, engine: Any) -> tuple:
    args: tuple = (("model", getattr(model, "name", "?")), ("in", _label(inp)),
                   ("out", _label(out)))
    if engine is not None:
        args += (("engine", _num(engine)),)
    if tag is not None:
        args += (("tag", [tag.job_id, tag.seq_id, tag.generation]),)
    return args
