"""CalRT return codes, their classification, and calfsm's one exception hierarchy.

Theory of operation
-------------------
Every CalRT call returns an integer code. calfsm never lets one pass unchecked: a code
becomes a :class:`CalfsmError` through :func:`from_calrt`, which looks it up in
:data:`CODE_TABLE` (code -> error category and exception class). The category decides
what the *service* does (:data:`ACTIONS`: fail the job, pause or stop admission, drain,
reset, roll back the model); the exception class decides what the *caller* sees (HTTP
status and gRPC status name). Both tables are data, so a reviewer can check them against
the spec's section 8 line by line, and tests iterate over them.

Codes 3, 6 and 26 are not named by the spec's table. calfsm names them for the
conditions its drivers must report and the spec leaves unnumbered: 3 ``NOT_FOUND`` (a
tensor, CSR or model name the device does not know: a manifest difference, so it joins
the request/artifact row of 14/21/22; but see :func:`csr_refused` for a CSR the configured
device itself declared), 6 ``INVALID_STATE`` (an API used out of order,
e.g. ``Wait`` on a buffer never submitted: a programming error) and 26
``HARD_RESET_FAILED`` (a device row, like 25). Any integer outside the enum is still
handled: category UNKNOWN, never a crash.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import attrs

__all__ = [
    "ACTIONS",
    "CODE_TABLE",
    "AdmissionEffect",
    "CalfsmError",
    "CalrtCode",
    "Cancelled",
    "DeadlineExceeded",
    "ErrorCategory",
    "ExecutorBroken",
    "ExecutorClosed",
    "FailedPrecondition",
    "IllegalTransition",
    "Incompatible",
    "Internal",
    "InvalidArgument",
    "JobEffect",
    "LeaseError",
    "ManifestError",
    "RecoveryAction",
    "ResourceExhausted",
    "ServiceAction",
    "Unavailable",
    "Unsupported",
    "category_of",
    "check",
    "code_name",
    "csr_refused",
    "from_calrt",
    "output_fault",
]


class CalrtCode(enum.IntEnum):
    """Return codes of CalRT 0.7.6 (spec section 8). 0 is success."""

    SUCCESS = 0
    ALLOC_FAILED = 1
    ALREADY_REGISTERED = 2
    NOT_FOUND = 3
    INVALID_VALUE = 4
    INVALID_CONFIG = 5
    INVALID_STATE = 6
    ALREADY_CONFIGURED = 7
    DRIVER_INCOMPATIBLE = 8
    RUNTIME_TOO_OLD = 9
    FILE_NOT_FOUND = 10
    FILE_READ_FAILED = 11
    FILE_FORMAT_INVALID = 12
    TIMEOUT = 13
    OUT_OF_RANGE = 14
    UNEXPECTED = 15
    MISSING_CONFIG = 16
    DEVICE_BUSY = 17
    DEVICE_UNAVAILABLE = 18
    INVALID_CALBIN = 19
    UNKNOWN = 20
    DTYPE_MISMATCH = 21
    SHAPE_MISMATCH = 22
    DEPENDENCY_ERROR = 23
    MAP_BROKEN = 24
    SOFT_RESET_FAILED = 25
    HARD_RESET_FAILED = 26
    UNSUPPORTED = 27
    DEVICE_CRASHED = 28
    WRONG_DIRECTION = 29


def code_name(code: int) -> str:
    """The enum name of a code, or ``CODE_<n>`` for an integer CalRT 0.7.6 does not define."""
    try:
        return CalrtCode(code).name
    except ValueError:
        return f"CODE_{code}"


class ErrorCategory(enum.Enum):
    """Who is at fault and how far the damage reaches (spec section 8, column 2)."""

    REQUEST = "request"
    LIFECYCLE = "lifecycle"
    ARTIFACT = "artifact"
    COMPATIBILITY = "compatibility"
    TRANSIENT = "transient"
    DEVICE = "device"
    PROGRAMMING = "programming"
    UNKNOWN = "unknown"


class JobEffect(enum.Enum):
    """What happens to the job that met the error."""

    FAIL = "fail"
    FAIL_OR_REQUEUE = "fail or requeue"


class AdmissionEffect(enum.Enum):
    """What happens to new admissions after the error."""

    CONTINUE = "continue"
    PAUSE = "pause"
    REJECT_GENERATION = "reject generation"
    STOP = "stop"
    REDUCE = "reduce"
    STOP_NOW = "stop now"
    FEATURE_OFF = "feature off"


class RecoveryAction(enum.Enum):
    """The automatic action the fault controller takes."""

    RECORD_MANIFEST_DIFF = "record manifest diff, no reset"
    DRAIN_CHECK_GENERATION = "drain, check generation/config"
    ROLLBACK_MODEL = "roll back to last known-good model"
    OPERATOR_FIX = "operator fix, no automatic retry"
    BACKOFF_THEN_DRAIN = "bounded backoff, drain past a threshold"
    QUARANTINE_RESET = "quarantine -> reset/restart/escalate"
    NO_RESET = "no reset, fix code or configuration"
    TAINT_GENERATION = "treat the generation as tainted"


@attrs.frozen
class ServiceAction:
    """One row of the spec's section 8 table, as data."""

    job: JobEffect
    admission: AdmissionEffect
    action: RecoveryAction


ACTIONS: dict[ErrorCategory, ServiceAction] = {
    ErrorCategory.REQUEST: ServiceAction(
        JobEffect.FAIL, AdmissionEffect.CONTINUE, RecoveryAction.RECORD_MANIFEST_DIFF),
    ErrorCategory.LIFECYCLE: ServiceAction(
        JobEffect.FAIL, AdmissionEffect.PAUSE, RecoveryAction.DRAIN_CHECK_GENERATION),
    ErrorCategory.ARTIFACT: ServiceAction(
        JobEffect.FAIL, AdmissionEffect.REJECT_GENERATION, RecoveryAction.ROLLBACK_MODEL),
    ErrorCategory.COMPATIBILITY: ServiceAction(
        JobEffect.FAIL, AdmissionEffect.STOP, RecoveryAction.OPERATOR_FIX),
    ErrorCategory.TRANSIENT: ServiceAction(
        JobEffect.FAIL_OR_REQUEUE, AdmissionEffect.REDUCE, RecoveryAction.BACKOFF_THEN_DRAIN),
    ErrorCategory.DEVICE: ServiceAction(
        JobEffect.FAIL, AdmissionEffect.STOP_NOW, RecoveryAction.QUARANTINE_RESET),
    ErrorCategory.PROGRAMMING: ServiceAction(
        JobEffect.FAIL, AdmissionEffect.FEATURE_OFF, RecoveryAction.NO_RESET),
    ErrorCategory.UNKNOWN: ServiceAction(
        JobEffect.FAIL, AdmissionEffect.PAUSE, RecoveryAction.TAINT_GENERATION),
}


class CalfsmError(Exception):
    """Root of every error calfsm raises.

    Each error knows its category (what the service does about it), the HTTP and gRPC
    status a server returns for it, and the context needed to find it in a log: job id,
    sequence id, generation, the raw CalRT code and the pipeline stage.
    """

    http_status: ClassVar[int] = 500
    grpc_code: ClassVar[str] = "INTERNAL"
    default_category: ClassVar[ErrorCategory] = ErrorCategory.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        category: ErrorCategory | None = None,
        job_id: int | None = None,
        seq_id: int | None = None,
        generation: int | None = None,
        calrt_code: int | None = None,
        stage: str | None = None,
        retry_after_s: float | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.category = category or self.default_category
        self.job_id = job_id
        self.seq_id = seq_id
        self.generation = generation
        self.calrt_code = calrt_code
        self.stage = stage
        self.retry_after_s = retry_after_s
        self.request_id = request_id

    _CONTEXT_FIELDS: ClassVar[tuple[str, ...]] = (
        "job_id", "seq_id", "generation", "calrt_code", "stage", "retry_after_s",
        "request_id")

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed if sent again later: the executor gave a
        retry-after hint, or the error is transient. Request, artifact, programming and
        compatibility errors repeat."""
        return self.retry_after_s is not None or self.category is ErrorCategory.TRANSIENT

    @property
    def action(self) -> ServiceAction:
        """The service action of this error's category (spec section 8)."""
        return ACTIONS[self.category]

    def context(self) -> dict[str, Any]:
        """Structured fields for logging (``logger.error(..., extra=err.context())``)."""
        return {
            "error": type(self).__name__,
            "category": self.category.value,
            "http_status": self.http_status,
            "grpc_code": self.grpc_code,
            "job_id": self.job_id,
            "seq_id": self.seq_id,
            "generation": self.generation,
            "calrt_code": self.calrt_code,
            "stage": self.stage,
            "retry_after_s": self.retry_after_s,
            "request_id": self.request_id,
        }

    def with_context(self, **context: Any) -> CalfsmError:
        """Fill in context fields that are still unset; returns ``self`` for chaining."""
        for key, value in context.items():
            if key not in self._CONTEXT_FIELDS:
                raise TypeError(f"unknown error context field {key!r}")
            if getattr(self, key) is None:
                setattr(self, key, value)
        return self

    def __str__(self) -> str:
        code = "-" if self.calrt_code is None else (
            f"{self.calrt_code}({code_name(self.calrt_code)})")
        # One log line, always: a multi-line message is joined, never split.
        message = " | ".join(self.message.splitlines()) or self.message
        parts = [
            f"{type(self).__name__}[{self.category.value}]: {message}",
            f"stage={self.stage or '-'}",
            f"job={_dash(self.job_id)}",
            f"seq={_dash(self.seq_id)}",
            f"gen={_dash(self.generation)}",
            f"calrt={code}",
            f"http={self.http_status}",
            f"grpc={self.grpc_code}",
        ]
        if self.retry_after_s is not None:
            parts.append(f"retry_after={self.retry_after_s:g}s")
        if self.request_id is not None:
            parts.append(f"req={self.request_id}")
        return " ".join(parts)

    def __reduce__(self):  # keep errors picklable with their context
        return (_rebuild, (type(self), self.message, self.category,
                           {k: getattr(self, k) for k in self._CONTEXT_FIELDS}))


def _rebuild(cls, message, category, context):
    return cls(message, category=category, **context)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


class InvalidArgument(CalfsmError):
    """The request itself is wrong (bad lengths, shapes, out-of-range slices).
    ``field``, when known, names the argument refused (e.g. ``temperature``), so a
    server answers with it as ``param`` without reading the message."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    default_category = ErrorCategory.REQUEST
    _CONTEXT_FIELDS = (*CalfsmError._CONTEXT_FIELDS, "field")

    def __init__(self, message: str, *, field: str | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.field = field


class FailedPrecondition(CalfsmError):
    """The request is well-formed but the system is not in a state to run it
    (e.g. a sequence whose KV state is Unknown and must be reset by the caller)."""

    http_status = 400
    grpc_code = "FAILED_PRECONDITION"
    default_category = ErrorCategory.REQUEST


class ResourceExhausted(CalfsmError):
    """KV capacity, token budget or queue is full."""

    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"
    default_category = ErrorCategory.REQUEST


class DeadlineExceeded(CalfsmError):
    """An admission, queue or execution deadline passed."""

    http_status = 504
    grpc_code = "DEADLINE_EXCEEDED"
    default_category = ErrorCategory.TRANSIENT


class Unavailable(CalfsmError):
    """The device is draining, recovering or failed (a closed executor raises the
    :class:`ExecutorClosed` subclass)."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    default_category = ErrorCategory.DEVICE


class ExecutorClosed(Unavailable):
    """The executor was used after ``close()`` began: the caller's misuse (or a server
    shutting down), never a statement about the device."""

    default_category = ErrorCategory.PROGRAMMING


class Internal(CalfsmError):
    """An internal shape/calbin error or an unexpected runtime condition."""

    http_status = 500
    grpc_code = "INTERNAL"
    default_category = ErrorCategory.UNKNOWN


class ExecutorBroken(Internal):
    """A worker thread of the executor died: every pending job fails with this and the
    executor admits nothing more (like ``concurrent.futures``' ``BrokenExecutor``)."""

    default_category = ErrorCategory.PROGRAMMING


class Incompatible(Internal):
    """Driver or runtime incompatible with this build; an operator must fix it."""

    default_category = ErrorCategory.COMPATIBILITY


class Cancelled(CalfsmError):
    """The caller cancelled the job (or shutdown cancelled it before submit)."""

    http_status = 499
    grpc_code = "CANCELLED"
    default_category = ErrorCategory.REQUEST


class Unsupported(CalfsmError):
    """A feature the device or this build does not offer."""

    http_status = 501
    grpc_code = "UNIMPLEMENTED"
    default_category = ErrorCategory.PROGRAMMING


class ManifestError(Internal):
    """A manifest that does not parse or disagrees with itself or with the device.

    The message names the field path (``submodels[1].logits.byte_size``) and the value.
    """

    default_category = ErrorCategory.ARTIFACT


class IllegalTransition(Internal):
    """A state machine trigger that is not allowed in the current state."""

    default_category = ErrorCategory.PROGRAMMING

    def __init__(self, machine: str, state: str, trigger: str, **context: Any) -> None:
        super().__init__(
            f"machine {machine!r} cannot fire {trigger!r} in state {state!r}", **context)
        self.machine = machine
        self.state = state
        self.trigger = trigger

    def __reduce__(self):
        return (_rebuild_transition, (self.machine, self.state, self.trigger, self.category,
                                      {k: getattr(self, k) for k in self._CONTEXT_FIELDS}))


def _rebuild_transition(machine, state, trigger, category, context):
    return IllegalTransition(machine, state, trigger, category=category, **context)


class LeaseError(Internal):
    """A buffer lease used after it was moved or returned, returned twice, or returned
    to a pool of another generation: a bug in the caller, never a device condition."""

    default_category = ErrorCategory.PROGRAMMING


# code -> (category, exception class). The one place a code is classified.
CODE_TABLE: dict[CalrtCode, tuple[ErrorCategory, type[CalfsmError]]] = {
    CalrtCode.ALLOC_FAILED: (ErrorCategory.REQUEST, ResourceExhausted),
    CalrtCode.NOT_FOUND: (ErrorCategory.REQUEST, Internal),
    CalrtCode.OUT_OF_RANGE: (ErrorCategory.REQUEST, InvalidArgument),
    CalrtCode.DTYPE_MISMATCH: (ErrorCategory.REQUEST, Internal),
    CalrtCode.SHAPE_MISMATCH: (ErrorCategory.REQUEST, Internal),
    CalrtCode.ALREADY_REGISTERED: (ErrorCategory.LIFECYCLE, Unavailable),
    CalrtCode.ALREADY_CONFIGURED: (ErrorCategory.LIFECYCLE, Unavailable),
    CalrtCode.MISSING_CONFIG: (ErrorCategory.LIFECYCLE, Unavailable),
    CalrtCode.INVALID_VALUE: (ErrorCategory.ARTIFACT, Internal),
    CalrtCode.INVALID_CONFIG: (ErrorCategory.ARTIFACT, Internal),
    CalrtCode.INVALID_CALBIN: (ErrorCategory.ARTIFACT, Internal),
    CalrtCode.FILE_NOT_FOUND: (ErrorCategory.ARTIFACT, Internal),
    CalrtCode.FILE_READ_FAILED: (ErrorCategory.ARTIFACT, Internal),
    CalrtCode.FILE_FORMAT_INVALID: (ErrorCategory.ARTIFACT, Internal),
    CalrtCode.DRIVER_INCOMPATIBLE: (ErrorCategory.COMPATIBILITY, Incompatible),
    CalrtCode.RUNTIME_TOO_OLD: (ErrorCategory.COMPATIBILITY, Incompatible),
    CalrtCode.DEPENDENCY_ERROR: (ErrorCategory.COMPATIBILITY, Incompatible),
    CalrtCode.TIMEOUT: (ErrorCategory.TRANSIENT, DeadlineExceeded),
    CalrtCode.DEVICE_BUSY: (ErrorCategory.TRANSIENT, Unavailable),
    CalrtCode.DEVICE_UNAVAILABLE: (ErrorCategory.DEVICE, Unavailable),
    CalrtCode.MAP_BROKEN: (ErrorCategory.DEVICE, Unavailable),
    CalrtCode.SOFT_RESET_FAILED: (ErrorCategory.DEVICE, Unavailable),
    CalrtCode.HARD_RESET_FAILED: (ErrorCategory.DEVICE, Unavailable),
    CalrtCode.DEVICE_CRASHED: (ErrorCategory.DEVICE, Unavailable),
    CalrtCode.UNSUPPORTED: (ErrorCategory.PROGRAMMING, Unsupported),
    CalrtCode.WRONG_DIRECTION: (ErrorCategory.PROGRAMMING, Internal),
    CalrtCode.INVALID_STATE: (ErrorCategory.PROGRAMMING, Internal),
    CalrtCode.UNEXPECTED: (ErrorCategory.UNKNOWN, Internal),
    CalrtCode.UNKNOWN: (ErrorCategory.UNKNOWN, Internal),
}

_UNCLASSIFIED = (ErrorCategory.UNKNOWN, Internal)


def category_of(code: int) -> ErrorCategory:
    """Category of a runtime code; UNKNOWN for any integer the table does not list."""
    if code == CalrtCode.SUCCESS:
        raise ValueError("CalRT code 0 is success, not an error")
    return CODE_TABLE.get(code, _UNCLASSIFIED)[0]  # type: ignore[call-overload]


def from_calrt(code: int, stage: str, message: str | None = None,
               **context: Any) -> CalfsmError:
    """Build the calfsm error for a non-zero CalRT return code met at ``stage``."""
    code = int(code)
    if code == CalrtCode.SUCCESS:
        raise ValueError(f"from_calrt called with success at stage {stage!r}")
    category, cls = CODE_TABLE.get(code, _UNCLASSIFIED)  # type: ignore[call-overload]
    text = message or f"CalRT returned {code_name(code)} at {stage}"
    return cls(text, category=category, calrt_code=code, stage=stage, **context)


def csr_refused(code: int, name: str, *, declared: bool, **context: Any) -> CalfsmError:
    """The error of a CSR write the device refused with ``code`` (stage ``csr``).

    ``declared``: ``name`` is a CSR of the job's graph as the configured device listed it
    (every manifest CSR is checked against the device's own model list at bring-up, so
    a name that could not exist fails start-up: FI01/FI02). NOT_FOUND for such a name
    says the device lost part of the configuration it reported for this generation —
    the device is wrong, not the request and not calfsm: category DEVICE (admission
    stops at once, the generation is drained and reset), raised as
    :class:`Unavailable` (503). Counting it as a request error let a device that
    refuses every CSR write fail each job with a 500 while it called itself ready.
    Every other code, and a name nothing declared, takes its row of
    :data:`CODE_TABLE`."""
    code = int(code)
    if declared and code == CalrtCode.NOT_FOUND:
        return Unavailable(
            f"CSR {name!r}, declared by the configured device, is now NOT_FOUND: the "
            "device lost its configuration", category=ErrorCategory.DEVICE,
            calrt_code=code, stage="csr", **context)
    return from_calrt(code, "csr", **context)


def output_fault(message: str, *, calrt_code: int | None = None,
                 **context: Any) -> Internal:
    """The error of a job the device says finished well but whose output breaks the
    contract: fewer bytes than the row needs (FI09) or a non-finite logit (FI10).

    The device's word on its own output cannot be trusted, so this is category UNKNOWN
    (the generation is tainted: drain, reset, warm-up golden), never REQUEST: the
    request was fine, and a request error would leave the device serving while every
    such job quarantines a buffer slot. ``calrt_code`` names the closest CalRT condition
    (SHAPE_MISMATCH for a short output) without taking that code's row of
    :data:`CODE_TABLE`, which is about the runtime refusing a call."""
    return Internal(message, category=ErrorCategory.UNKNOWN, calrt_code=calrt_code,
                    **context)


def check(code: int, stage: str, **context: Any) -> None:
    """Raise the classified error unless ``code`` is success: the one status check."""
    if code != 0:
        raise from_calrt(code, stage, **context)
