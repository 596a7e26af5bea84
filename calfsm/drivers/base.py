"""The Driver protocol: everything calfsm may ask of a device, mirroring CalRT 0.7.6.

Theory of operation
-------------------
A driver is a thin, honest window onto one device. It never raises for a *device*
condition: every call that CalRT can fail returns the CalRT integer code (0 = success)
— or, for ``KvManager::Apply``/``canAllocate``, the bare bool CalRT returns — exactly as
the vendor runtime does, so the executor's single status check (:func:`calfsm.errors.check`)
is the only place codes become exceptions. A driver raises only for *misuse by Python
code* that CalRT could not even express (a handle of another driver, a closed driver).

The memory model is CalRT's: a host numpy array mapped into a buffer (``MapBuf``) is
read by the device *when the job runs*, not when it is submitted, and written back when
the job completes. The caller must keep the array alive, unmoved and unresized until
``wait`` reported completion; calfsm's :class:`~calfsm.engine.buffers.BufferPool` guarantees it.

A driver declares its :class:`Capabilities`; callers ask, never assume (a driver without
``ResetKind.FULL`` cannot recover a wedged device in-process; one without
``fixed_engine_slots`` cannot run ping/pong). Parallel mode is off after every reset; a
host that runs ping/pong enables it again (``docs/driver-protocol.md``, Parallel mode).

Optional beyond :class:`Driver`: ``timeline()``, the per-job phase spans of a device that
models them (:class:`calfsm.drivers.timeline.PhaseTimeline`); a real device has none.

Call-by-call correspondence with CalRT 0.7.6:

==========================  =====================================================
Driver method               CalRT 0.7.6
==========================  =====================================================
``configure``               ``VirtualDevice::Configure(Calbin)``
``get_all_models``          ``Calbin::GetAllModels`` + tensor metadata
``model``                   exact-name lookup in that list (never substring, S08)
``create_buffers``          ``CalrtInputBuf``/``CalrtOutputBuf`` construction
``map_buffer``              ``MapBuf``
``slice_tensor``            ``SliceTensor``; ``undo_slice`` its reset
``set_csr``                 ``SetCsrByName``
``set_kv_seq``              the ``KvSeqId`` an input buffer's job reads and writes
``set_batch_rows``          the rows of a batch graph's job (batch calbins only)
``row_status``              a batch job's per-row outcome (batch calbins only)
``infer``                   ``calrt::infer``
``infer_fixed``             ``calrt::infer_with_fixed_task_type`` (Ping/Pong)
``wait``                    ``CalrtOutputBuf::Wait``
``status``                  ``CalrtOutputBuf::GetStatus``
``output_bytes``            ``CalrtOutputBuf`` tensor ``ByteSize()`` after the job
``kv_can_allocate``         ``KvManager::canAllocate``
``kv_apply``                ``KvManager::Apply``
``kv_release``              ``KvManager::Release``
``reset``                   ``ResetCCU`` / ``ResetConfiguration`` / ``Reset``
``enable_parallel_mode``    ``EnableParallelMode``
==========================  =====================================================
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import attrs
import numpy as np

from calfsm.clock import Clock
from calfsm.errors import CalrtCode, ManifestError
from calfsm.manifest import MAX_FILE_BYTES, DType, Manifest, ModelInfo, TaskKind, TensorInfo
from calfsm.util.boundedio import load_json, read_or_raise

__all__ = [
    "MAX_WAIT_S",
    "SEQ_LIMIT",
    "U32_MAX",
    "BatchDriver",
    "Calbin",
    "Capabilities",
    "ClosesOnExit",
    "Driver",
    "EngineSlot",
    "HandleChecks",
    "JobTag",
    "ModelHandle",
    "OutputStatus",
    "ResetKind",
    "is_int",
    "runtime_code",
    "tensor_table",
    "wait_timeout",
]


#: Largest CSR value (CalRT CSRs are 32-bit unsigned).
U32_MAX = 2**32 - 1
#: KV sequence ids are ``0 <= seq_id < SEQ_LIMIT`` (a signed 32-bit ``KvSeqId``).
SEQ_LIMIT = 2**31


def is_int(x: Any) -> bool:
    """An integer argument as the protocol accepts it (numpy integers yes, bools no)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


class OutputStatus(enum.IntEnum):
    """``CalrtOutputBuf::GetStatus`` values."""

    IDLE = 0                 #: never submitted (or status consumed by a new map)
    PENDING = 1              #: submitted, not finished
    DONE_OK = 2              #: finished, output written
    DONE_CCU_EXCEPTION = 3   #: the compute unit raised an exception (bad CSR/slice/KV)
    DONE_ABORTED = 4         #: killed by a reset before it finished; output not written


class EngineSlot(enum.IntEnum):
    """Spec ``EngineSlot``: which engine a buffer set is bound to."""

    AUTO = -1
    PING = 0
    PONG = 1


class ResetKind(enum.StrEnum):
    CCU = "ccu"                      #: ``ResetCCU``: the compute unit only
    CONFIGURATION = "configuration"  #: ``ResetConfiguration``: drop the configured calbin
    FULL = "full"                    #: ``Reset``: the whole device, KV included


@attrs.frozen
class Capabilities:
    """What a driver can do; the executor asks before it relies on any of it."""

    resets: frozenset[ResetKind] = frozenset()
    parallel_mode: bool = False
    fixed_engine_slots: bool = False
    engine_slots: int = 1
    #: the driver has the batch calls (:class:`BatchDriver`): several rows per job on a
    #: model with ``max_batch > 1`` (``docs/driver-protocol.md``, Batches). Whether the
    #: device's batch graphs keep their rows apart is the batch runner's evidence, never
    #: this flag
    batch_rows: bool = False

    def can_reset(self, kind: ResetKind) -> bool:
        return kind in self.resets


@attrs.frozen
class JobTag:
    """Who a device call is for. Not part of CalRT: drivers use it only for their trace
    and for fault plans that match by job or sequence."""

    job_id: int
    seq_id: int
    generation: int = 0


@attrs.frozen
class Calbin:
    """A compiled artifact as the device sees it: the models it holds with their metadata.

    A real calbin is an opaque vendor file; ours is a JSON description that the simulated
    driver and the native emulator both accept, so tests can build a calbin that
    disagrees with a manifest in exactly one place (FI01).
    """

    models: tuple[ModelInfo, ...]
    sha256: str = ""
    calrt_version: str = "0.7.6"

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> Calbin:
        """The calbin a manifest describes (what the compiler would have produced)."""
        models = []
        for sub in manifest.submodels:
            t = sub.token_or_embed, sub.position
            models.append(ModelInfo(
                name=sub.exact_name, kind=sub.kind,
                inputs=tuple(TensorInfo(x.name, x.shape, x.dtype, x.byte_size) for x in t),
                outputs=(TensorInfo(sub.logits.name, sub.logits.shape, sub.logits.dtype,
                                    sub.logits.byte_size),),
                csr_names=(sub.csr_cur_seq, sub.csr_total_seq),
                tile_d0=sub.logits_tile_d0 if sub.kind.is_prefill else None))
        return cls(tuple(models), manifest.calbin_sha256, manifest.calrt_version)

    def replace_model(self, name: str, /, **changes: Any) -> Calbin:
        """A copy with one model changed (e.g. ``name="..."`` for FI01)."""
        found = False
        models = []
        for m in self.models:
            if m.name == name:
                found = True
                m = attrs.evolve(m, **changes)
            models.append(m)
        if not found:
            raise KeyError(name)
        return attrs.evolve(self, models=tuple(models))

    def to_json(self) -> str:
        def tensor(t: TensorInfo) -> dict:
            return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype.value,
                    "byte_size": t.byte_size}
        return json.dumps({
            "sha256": self.sha256, "calrt_version": self.calrt_version,
            "models": [{"name": m.name, "kind": m.kind.value if m.kind else None,
                        "inputs": [tensor(t) for t in m.inputs],
                        "outputs": [tensor(t) for t in m.outputs],
                        "csr_names": list(m.csr_names), "tile_d0": m.tile_d0}
                       for m in self.models]}, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Calbin:
        try:
            data = load_json(text)
            models = tuple(
                ModelInfo(
                    name=m["name"], kind=TaskKind(m["kind"]) if m["kind"] else None,
                    inputs=tuple(_tensor(t) for t in m["inputs"]),
                    outputs=tuple(_tensor(t) for t in m["outputs"]),
                    csr_names=tuple(m["csr_names"]), tile_d0=m.get("tile_d0"))
                for m in data["models"])
            return cls(models, data.get("sha256", ""), data.get("calrt_version", "0.7.6"))
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"calbin description does not parse: {e!r}",
                                stage="calbin") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(), "utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calbin:
        """A calbin description file (a regular file; bounded like a manifest)."""
        return cls.from_json(read_or_raise(
            path, max_bytes=MAX_FILE_BYTES, error=lambda why: ManifestError(
                f"cannot read calbin {str(path)!r}: {why}", stage="calbin")))

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


#: the longest wait the C ABI carries, 2**62 ns (about 146 years): a longer finite
#: timeout is clamped to it (docs/driver-protocol.md, ``wait``)
MAX_WAIT_S = 2**62 / 1e9


def wait_timeout(timeout_s: Any) -> float | None:
    """A ``wait`` timeout as every driver reads it: None when it is no number of seconds
    (not a real number, a bool, NaN: the call returns ``INVALID_VALUE``); otherwise
    clamped into ``[0, MAX_WAIT_S]`` (a negative timeout counts as 0), an infinite one
    kept (no limit). ``1e300`` is ``MAX_WAIT_S`` on every driver, never an
    ``OverflowError``."""
    if isinstance(timeout_s, bool | np.bool_) or not isinstance(timeout_s, numbers.Real):
        return None
    try:
        t = float(timeout_s)
    except OverflowError:               # an int or Fraction beyond any float
        return MAX_WAIT_S if timeout_s > 0 else 0.0
    if math.isnan(t):
        return None
    if math.isinf(t):
        return t if t > 0 else 0.0
    return min(max(t, 0.0), MAX_WAIT_S)


def runtime_code(calbin_version: str, runtime_version: str) -> int:
    """What ``configure`` answers for a calbin built for CalRT ``calbin_version`` on a
    device running ``runtime_version`` (spec 8, compatibility): 0 when they are the same;
    ``RUNTIME_TOO_OLD`` (9) when the calbin is for a newer runtime; otherwise
    ``DRIVER_INCOMPATIBLE`` (8): an older one, or a version that is not dotted numbers.
    A calbin is compiled for one runtime version, so only equal versions run."""
    if calbin_version == runtime_version:
        return 0
    want, have = _version_key(calbin_version), _version_key(runtime_version)
    if want is not None and have is not None and want > have:
        return int(CalrtCode.RUNTIME_TOO_OLD)
    return int(CalrtCode.DRIVER_INCOMPATIBLE)


def _version_key(version: str) -> tuple[int, ...] | None:
    parts = version.split(".") if isinstance(version, str) else []
    return tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) \
        else None


def _tensor(t: dict) -> TensorInfo:
    return TensorInfo(t["name"], tuple(t["shape"]), DType(t["dtype"]), t["byte_size"])


class ModelHandle(Protocol):
    """An opaque configured model (a sub-model of the calbin), found by exact name."""

    name: str


class ClosesOnExit:
    """``with driver:`` closes the driver when the block ends (a mixin of the shipped
    drivers; a driver of your own may use it or not)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define close()")


class HandleChecks:
    """The handle checks of the shipped drivers, written once (a mixin; a driver of your
    own may use it or not).

    The subclass names its handle types in ``_MODEL`` and ``_BUF`` and keeps ``_closed``,
    ``_epoch`` (bumped by every configuration or full reset) and ``_configured`` (truthy
    while a calbin is configured). A model handle has ``driver``, ``epoch`` and
    ``tensors`` (name -> ``(TensorInfo, is_input)``); a buffer ``driver``, ``model``,
    ``epoch``, ``destroyed`` and ``is_input``."""

    _MODEL: ClassVar[type]
    _BUF: ClassVar[type]
    _closed: bool
    _epoch: int
    _configured: Any

    def _model_ok(self, m: Any) -> bool:
        """A model handle of this driver and of the current configuration."""
        return (isinstance(m, self._MODEL) and m.driver is self and m.epoch == self._epoch
                and bool(self._configured))

    def _buf_ok(self, b: Any) -> bool:
        """A buffer of this driver, not destroyed, of the current configuration."""
        return (isinstance(b, self._BUF) and b.driver is self and not b.destroyed
                and b.epoch == self._epoch and bool(self._configured))

    def _tensor(self, buf: Any, tensor: Any) -> tuple[int, TensorInfo | None]:
        """(0, TensorInfo) of a tensor of the buffer's direction, or the code: a closed
        driver or a stale/foreign buffer is INVALID_STATE before any name check, then an
        unknown name NOT_FOUND, then a tensor of the other direction WRONG_DIRECTION."""
        if self._closed or not self._buf_ok(buf):
            return _INVALID_STATE, None
        entry = buf.model.tensors.get(tensor) if isinstance(tensor, str) else None
        if entry is None:
            return _NOT_FOUND, None
        info, is_input = entry
        if is_input != buf.is_input:
            return _WRONG_DIRECTION, None
        return 0, info


def tensor_table(info: ModelInfo) -> dict[str, tuple[TensorInfo, bool]]:
    """A model's tensors by name: ``(TensorInfo, is_input)`` (what :class:`HandleChecks`
    reads from ``model.tensors``)."""
    table = {t.name: (t, True) for t in info.inputs}
    table.update({t.name: (t, False) for t in info.outputs})
    return table


_INVALID_STATE = int(CalrtCode.INVALID_STATE)
_NOT_FOUND = int(CalrtCode.NOT_FOUND)
_WRONG_DIRECTION = int(CalrtCode.WRONG_DIRECTION)


@runtime_checkable
class Driver(Protocol):
    """What calfsm may ask of a device. See the module docstring for the CalRT mapping.

    Handles (models, input and output buffers) are opaque objects owned by the driver.
    Methods return CalRT codes; a tuple ``(code, value)`` where CalRT fills an
    out-parameter. ``value`` is None whenever ``code`` is not success.
    """

    name: str
    clock: Clock

    # ---- identity and capabilities ------------------------------------------------
    def version(self) -> str: ...
    def capabilities(self) -> Capabilities: ...

    # ---- configuration ------------------------------------------------------------
    def configure(self, calbin: Calbin) -> int: ...
    def get_all_models(self) -> tuple[int, Sequence[ModelInfo] | None]: ...
    def model(self, exact_name: str) -> tuple[int, ModelHandle | None]: ...

    # ---- buffers --------------------------------------------------------------------
    def create_buffers(self, model: ModelHandle, engine: EngineSlot = EngineSlot.AUTO
                       ) -> tuple[int, tuple[Any, Any] | None]: ...
    def destroy_buffers(self, inp: Any, out: Any) -> int: ...
    def map_buffer(self, buf: Any, tensor: str, host: np.ndarray) -> int: ...
    def slice_tensor(self, buf: Any, tensor: str, offset: int, size: int) -> int: ...
    def undo_slice(self, buf: Any, tensor: str) -> int: ...
    def set_csr(self, inp: Any, name: str, value: int, row: int = 0) -> int: ...
    def set_kv_seq(self, inp: Any, seq_id: int, row: int = 0) -> int: ...

    # ---- execution ------------------------------------------------------------------
    def infer(self, model: ModelHandle, inp: Any, out: Any, *,
              tag: JobTag | None = None) -> int: ...
    def infer_fixed(self, model: ModelHandle, inp: Any, out: Any, engine: EngineSlot, *,
                    tag: JobTag | None = None) -> int: ...
    def wait(self, out: Any, timeout_s: float) -> int: ...
    def status(self, out: Any) -> OutputStatus: ...
    def output_bytes(self, out: Any, tensor: str) -> tuple[int, int | None]: ...

    # ---- KV manager -----------------------------------------------------------------
    def kv_can_allocate(self, n: int) -> bool: ...
    def kv_apply(self, seq_id: int, target_len: int) -> bool: ...
    def kv_release(self, seq_id: int, keep_len: int = 0) -> int: ...

    # ---- device control -------------------------------------------------------------
    def reset(self, kind: ResetKind) -> int: ...
    def enable_parallel_mode(self, enabled: bool) -> int: ...
    def close(self) -> None: ...


@runtime_checkable
class BatchDriver(Driver, Protocol):
    """A driver with the batch calls (``Capabilities.batch_rows``): a job of a model whose
    tensors are ``[B, ...]`` carries 1..B rows, each with its own KV sequence and CSRs
    (``set_kv_seq``/``set_csr`` with ``row=``), and each row ends on its own
    (``docs/driver-protocol.md``, Batches). A driver without them runs batch-1 jobs
    only, on any calbin."""

    def set_batch_rows(self, inp: Any, rows: int) -> int: ...
    def row_status(self, out: Any, row: int) -> OutputStatus: ...

