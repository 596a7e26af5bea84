"""calfsm: run LLM inference jobs on the Calculet NPU and stay correct when it misbehaves.

The public API is re-exported here (``from calfsm import DeviceExecutor, Request``); see
README.md and docs/architecture.md. The drivers (``SimDriver``, ``CalrtDriver``, with
``FaultPlan`` and ``FaultRule``) are imported on first use, as every heavy dependency is
(the cffi driver loads cffi and the native library; ml_dtypes, the server, metrics and
plots load where they are used): ``import calfsm`` stays light for an embedder.
"""

import importlib
from typing import TYPE_CHECKING, Any

from calfsm import _moved
from calfsm.config import DumpConfig
from calfsm.engine.job import InferenceResult, JobHandle, JobTimings
from calfsm.engine.observe import JobAccepted, JobEnded, Observer
from calfsm.engine.recovery import RecoveryPolicy
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
from calfsm.generate.constraint import Choice, Grammar, JsonObject, JsonSchema, Regex
from calfsm.generate.promptcache import PromptCacheConfig, PromptCacheStats
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.sequence import Sequence
from calfsm.generate.stream import FinishReason, GenerationResult, Stream, TokenEvent, Usage
from calfsm.manifest import (
    DType,
    Manifest,
    ModelGeneration,
    SubmodelContract,
    TaskKind,
    TensorContract,
    builtin_manifest,
)
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler

_moved.install()     # the module paths of calfsm before its folders drew the layers

if TYPE_CHECKING:
    from calfsm.drivers.calrt import CalrtDriver
    from calfsm.drivers.faults import FaultPlan, FaultRule
    from calfsm.drivers.sim import SimDriver

__version__ = "0.1.0"

__all__ = [
    "CalfsmError",
    "CalrtCode",
    "CalrtDriver",
    "Cancelled",
    "Choice",
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
    "Grammar",
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
    "JsonObject",
    "JsonSchema",
    "LeaseError",
    "Manifest",
    "ManifestError",
    "ModelGeneration",
    "Observer",
    "PromptCacheConfig",
    "PromptCacheStats",
    "RecoveryPolicy",
    "Regex",
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


#: the public names imported at their first use: name -> the module that defines it
_LAZY = {
    "CalrtDriver": "calfsm.drivers.calrt",
    "FaultPlan": "calfsm.drivers.faults",
    "FaultRule": "calfsm.drivers.faults",
    "SimDriver": "calfsm.drivers.sim",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'calfsm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value             # bound once: later reads are plain attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
