"""The records of one executor: its configuration, its counters and its health.

Kept apart from :mod:`calfsm.executor` so the façade holds only the wiring; all three are
re-exported there and from :mod:`calfsm`. The dump sink's configuration is here too, so the
records sit below the telemetry that reads them (:mod:`calfsm.telemetry.dump` re-exports it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import ErrorCategory, InvalidArgument
from calfsm.generate.promptcache import PromptCacheConfig

__all__ = ["DumpConfig", "ExecutorConfig", "ExecutorStats", "Health"]


def _positive(inst: object, attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidArgument(f"ExecutorConfig.{attr.name} must be > 0, got {value!r}",
                              stage="config")


def _positive_finite(inst: object, attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 < value < float("inf"):
        raise InvalidArgument(f"ExecutorConfig.{attr.name} must be a finite number > 0, "
                              f"got {value!r}", stage="config")


def _non_negative(inst: object, attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidArgument(f"ExecutorConfig.{attr.name} must be >= 0, got {value!r}",
                              stage="config")


def _at_least_one(inst: object, attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"ExecutorConfig.{attr.name} must be an integer >= 1, got "
                              f"{value!r}", stage="config")


# ---- the dump sink's configuration (spec S12; the sink is calfsm.telemetry.dump) ----

def _bad_dump(msg: str) -> InvalidArgument:
    return InvalidArgument(msg, stage="config")


_CATEGORIES = frozenset(c.value for c in ErrorCategory)


def _directory(value: Any) -> Path:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise _bad_dump("DumpConfig.directory is required: calfsm has no default dump "
                   "directory (and never writes into a home directory by itself)")
    if not isinstance(value, str | os.PathLike):
        raise _bad_dump(f"DumpConfig.directory must be a path, got {value!r}")
    path = Path(value)
    if str(path).startswith("~"):
        raise _bad_dump(f"DumpConfig.directory {str(path)!r}: '~' is not expanded; give the "
                   "directory itself")
    return path


def _members(value: Any, field: str, what: str) -> list[Any]:
    """The members of the set-valued option ``field``: None, a string or anything that
    is not a collection is a configuration error, never a TypeError."""
    if isinstance(value, str | bytes):
        raise _bad_dump(f"DumpConfig.{field} is a set of {what}, got the string {value!r}")
    if not isinstance(value, Iterable):
        raise _bad_dump(f"DumpConfig.{field} is a set of {what}, got {value!r}")
    return list(value)


def dump_job_ids(value: Iterable[int]) -> frozenset[int]:
    """Job ids as the dump sink keeps them (integers >= 1), or InvalidArgument."""
    ids = _members(value, "job_ids", "job ids")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise _bad_dump(f"DumpConfig.job_ids holds {i!r}: job ids are integers >= 1")
    return frozenset(ids)


def _categories(value: Iterable[str | ErrorCategory]) -> frozenset[str]:
    items = _members(value, "categories", "categories")
    for c in items:
        if not isinstance(c, str | ErrorCategory):
            raise _bad_dump(f"DumpConfig.categories holds {c!r}: a category is an "
                       f"ErrorCategory or its name, one of {sorted(_CATEGORIES)}")
    cats = frozenset(c.value if isinstance(c, ErrorCategory) else c for c in items)
    unknown = sorted(map(str, cats - _CATEGORIES))
    if unknown:
        raise _bad_dump(f"DumpConfig.categories: unknown {unknown}; the categories are "
                   f"{sorted(_CATEGORIES)}")
    return cats


def _at_least_one(inst: object, attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad_dump(f"DumpConfig.{attr.name} must be an integer >= 1, got {value!r}")


@attrs.frozen
class DumpConfig:
    """Where and what the dump sink writes. ``directory`` is required (there is no
    default); a job is dumped when its id is in ``job_ids`` or it failed with an error
    whose category is in ``categories``."""

    directory: Path = attrs.field(default=None, converter=_directory)
    job_ids: frozenset[int] = attrs.field(default=frozenset(), converter=dump_job_ids)
    categories: frozenset[str] = attrs.field(default=frozenset(), converter=_categories)
    max_files: int = attrs.field(default=100, validator=_at_least_one)
    max_bytes: int = attrs.field(default=256 * 2**20, validator=_at_least_one)


def _dump_config(inst: object, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, DumpConfig):
        raise InvalidArgument(f"ExecutorConfig.dump must be a DumpConfig or None, got "
                              f"{value!r}", stage="config")


def _prompt_cache_config(inst: object, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, PromptCacheConfig):
        raise InvalidArgument(f"ExecutorConfig.prompt_cache must be a PromptCacheConfig or "
                              f"None, got {value!r}", stage="config")


@attrs.frozen
class ExecutorConfig:
    """Knobs of one executor. Times are seconds on the driver's clock."""

    max_inflight: int = attrs.field(default=1, validator=_at_least_one)
    threaded: bool = True
    admission_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    queue_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    #: how long ``wait`` may take before a job is given up as hung (FI07) and the device
    #: drained; None: ten times the step's expected time, at least 1 s (the manifest's
    #: ``timing``, raised to what the warm-up measured: calfsm/engine/stepcost.py)
    execution_timeout_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive))
    default_deadline_s: float = attrs.field(default=60.0, validator=_positive)
    slots_per_engine: int = attrs.field(default=2, validator=_at_least_one)
    token_budget: int | None = None
    shutdown_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    #: ``close()``: how long running streams may go on finishing (no new work is taken)
    #: before they are cut; 0: cut them at once
    shutdown_grace_s: float = attrs.field(default=0.0, validator=_non_negative)
    #: liveness: a job on the device this long (and past its execution timeout plus the
    #: drain's grace) means the device stopped making progress: ``health().live`` False
    hang_after_s: float = attrs.field(default=5.0, validator=_positive)
    #: refuse a new stream (429 with Retry-After) that, or that would make another
    #: stream, miss its deadline by the measured service rate (calfsm/generate/livestreams.py)
    admission_estimate: bool = True
    #: the estimate's safety factor on the modelled finishing times
    admission_slack: float = attrs.field(default=1.2, validator=_positive)
    warmup: bool = True
    recovery: RecoveryPolicy = attrs.field(factory=RecoveryPolicy)
    #: jobs that may wait for the device at once (accepted, not yet submitted); more are
    #: refused at once with ResourceExhausted (429) and a Retry-After. None: unbounded
    max_waiting: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least_one))
    #: sequence ids open_sequence() hands out: 0 .. max_sequences-1
    max_sequences: int = attrs.field(default=256, validator=_at_least_one)
    #: where the vendor runners' evidence files are (None: the one rule every command
    #: follows, calfsm.plan.capabilities.evidence_dir: ``$CALFSM_EVIDENCE_DIR``, else
    #: ``./evidence``); ``max_inflight=2`` runs two only when they prove it (inflight.py)
    evidence_dir: str | None = None
    #: the dump sink (spec S12): off (None) unless a DumpConfig names its directory
    dump: DumpConfig | None = attrs.field(default=None, validator=_dump_config)
    #: rows per device job on a batch calbin (continuous batching): None as many as the
    #: manifest's decode graph and the batch runner's evidence allow, 1 off. Batching
    #: runs only when the evidence proves it (calfsm/plan/batching.py)
    max_batch: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least_one))
    #: how long the submitter may hold a partial batch for rows a batch being completed
    #: is about to queue (threaded mode on a real clock; step mode, and a virtual clock,
    #: never wait)
    batch_window_s: float = attrs.field(default=0.002, validator=_non_negative)
    #: the aging of a parked job's priority: it grows by one for each this many seconds
    #: the job waits, so a job waits behind work accepted after it with a priority ``d``
    #: higher only if that work came within ``d * priority_aging_s`` of it
    #: (docs/architecture.md, Admission)
    priority_aging_s: float = attrs.field(default=1.0, validator=_positive_finite)
    #: keep a one-shot stream's sequence warm when it ends, for the next prompt that
    #: begins the same way (calfsm/generate/promptcache.py): off (None) unless a budget is given
    prompt_cache: PromptCacheConfig | None = attrs.field(default=None,
                                                         validator=_prompt_cache_config)


@attrs.frozen
class ExecutorStats:
    """Counters since start; a snapshot."""

    accepted: int
    succeeded: int
    failed: int
    cancelled: int
    quarantined: int
    discarded: int                  # a stream's step prepared ahead that was not needed
    stale_completions: int
    recoveries: int
    requeued: int
    inflight: int
    queued: int
    generation: int
    leased: int
    errors_by_category: dict[str, int]
    #: jobs in the admission queue now (waiting for KV or a buffer slot), of ``queued``
    admitting: int = 0


@attrs.frozen
class Health:
    """What a load balancer and a supervisor ask (spec section 9)."""

    state: str
    ready: bool
    generation: int
    inflight: int
    queue_depth: int
    submitter_heartbeat: float
    completion_heartbeat: float
    reason: str | None
    max_inflight: int = 1
    #: rows one device step carries at most (continuous batching; 1: off)
    max_batch: int = 1
    #: configuration the executor could not honour, and why (e.g. max_inflight)
    notes: tuple[str, ...] = ()
    broken: str | None = None
    #: liveness: False when only a restart helps (Failed, broken, a device that stopped
    #: making progress), with why in ``live_reason``
    live: bool = True
    live_reason: str | None = None
    #: clock seconds the oldest job on the device has been there (0: none)
    oldest_job_s: float = 0.0
    #: a job has been on the device past half its execution timeout: not ready
    hang_suspected: bool = False
    #: why ``ready`` is False (None when ready)
    ready_reason: str | None = None
