"""calfsm: run LLM inference jobs on the Calculet NPU and stay correct when it misbehaves.

The public API is re-exported here (``from calfsm import DeviceExecutor, Request``); see
README.md and docs/architecture.md. ``CalrtDriver`` is imported on first use: it loads
cffi and the native library.
"""

from typing import TYPE_CHECKING, Any

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.dump import DumpConfig
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    ExecutorBroken,
    ExecutorClosed,
    FailedPrecondition,
    IllegalTransition,
    Incompatible,
    Internal,
    InvalidArgument,
    LeaseError,
    ManifestError,
    ResourceExhausted,
    Unavailable,
    Unsupported,
    from_calrt,
)
from calfsm.executor import DeviceExecutor, ExecutorConfig, ExecutorStats, Health
from calfsm.job import InferenceResult, JobHandle, JobTimings
from calfsm.manifest import (
    DType,
    Manifest,
    ModelGeneration,
    SubmodelContract,
    TaskKind,
    TensorContract,
    builtin_manifest,
)
from calfsm.observe import JobAccepted, JobEnded, Observer
from calfsm.promptcache import PromptCacheConfig, PromptCacheStats
from calfsm.recovery import RecoveryPolicy
from calfsm.request import Request
from calfsm.sampling import SamplingParams
from calfsm.scheduler import StepScheduler
from calfsm.streams import FinishReason, GenerationResult, Sequence, Stream, TokenEvent, Usage

if TYPE_CHECKING:
    from calfsm.drivers.calrt import CalrtDriver

__version__ = "0.1.0"

__all__ = [
    "CalfsmError",
    "CalrtCode",
    "CalrtDriver",
    "Cancelled",
    "DType",
    "DeadlineExceeded",
    "DeviceExecutor",
    "DumpConfig",
    "ErrorCategory",
    "ExecutorBroken",
    "ExecutorClosed",
    "ExecutorConfig",
    "ExecutorStats",
    "FailedPrecondition",
    "FaultPlan",
    "FaultRule",
    "FinishReason",
    "GenerationResult",
    "Health",
    "IllegalTransition",
    "Incompatible",
    "InferenceResult",
    "Internal",
    "InvalidArgument",
    "JobAccepted",
    "JobEnded",
    "JobHandle",
    "JobTimings",
    "LeaseError",
    "Manifest",
    "ManifestError",
    "ModelGeneration",
    "Observer",
    "PromptCacheConfig",
    "PromptCacheStats",
    "RecoveryPolicy",
    "Request",
    "ResourceExhausted",
    "SamplingParams",
    "Sequence",
    "SimDriver",
    "StepScheduler",
    "Stream",
    "SubmodelContract",
    "TaskKind",
    "TensorContract",
    "TokenEvent",
    "Unavailable",
    "Unsupported",
    "Usage",
    "__version__",
    "builtin_manifest",
    "from_calrt",
]


def __getattr__(name: str) -> Any:
    if name == "CalrtDriver":          # cffi and the native library load only when used
        from calfsm.drivers.calrt import CalrtDriver
        return CalrtDriver
    raise AttributeError(f"module 'calfsm' has no attribute {name!r}")
