"""calfsm: run LLM inference jobs on the Calculet NPU and stay correct when it misbehaves.

The public API is re-exported here; see README.md and docs/.
"""

from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
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
from calfsm.manifest import (
    DType,
    Manifest,
    ModelGeneration,
    SubmodelContract,
    TaskKind,
    TensorContract,
    builtin_manifest,
)

__version__ = "0.1.0"

__all__ = [
    "CalfsmError",
    "CalrtCode",
    "Cancelled",
    "DType",
    "DeadlineExceeded",
    "ErrorCategory",
    "FailedPrecondition",
    "IllegalTransition",
    "Incompatible",
    "Internal",
    "InvalidArgument",
    "LeaseError",
    "Manifest",
    "ManifestError",
    "ModelGeneration",
    "ResourceExhausted",
    "SubmodelContract",
    "TaskKind",
    "TensorContract",
    "Unavailable",
    "Unsupported",
    "__version__",
    "builtin_manifest",
    "from_calrt",
]
