"""Per-job phase timelines: when a device moved a job's inputs, computed it and moved
its output back, so a runner can see whether two jobs on Ping and Pong overlapped.

Theory of operation
-------------------
A device that models its phases (the simulated driver, the native emulator) keeps a
bounded ring of the last jobs that *ended* — executed, or aborted by a reset or close —
with the planned start and end of each of its three phases (H2D and D2H on the one DMA
channel, compute on the one compute unit). :func:`spans_of_job` turns one such record
into :class:`PhaseSpan` values: the phases as they ran, cut at the moment an aborted job
ended (a phase that had not started yet is left out, the running one ends there).

The timeline is optional: a vendor device cannot report its internal phases, so
``timeline()`` returns None there, and a runner measures host-side timestamps instead.
:func:`phase_timeline` asks any driver and answers None when it has no timeline.

Times are seconds on the driver's own clock (``driver.clock``): virtual seconds on a
virtual clock, ``time.monotonic()`` seconds in real time.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from calfsm.drivers.base import EngineSlot, JobTag, OutputStatus
from calfsm.errors import InvalidArgument

__all__ = ["DEFAULT_TIMELINE_JOBS", "JobRing", "Phase", "PhaseSpan", "PhaseTimeline",
           "busy_s", "overlap_s", "phase_timeline", "spans_of_job"]

#: jobs a driver keeps in its timeline ring by default (~0.4 KB each in SimDriver)
DEFAULT_TIMELINE_JOBS = 256


class Phase(enum.StrEnum):
    """One stage of a job on the device."""

    H2D = "h2d"          #: inputs host -> device, on the DMA channel
    COMPUTE = "compute"  #: the graph, on the compute unit
    D2H = "d2h"          #: output device -> host, on the DMA channel

    @property
    def on_dma(self) -> bool:
        return self is not Phase.COMPUTE


@attrs.frozen
class PhaseSpan:
    """One phase of one job: ``[start, end)`` in seconds on the driver's clock."""

    job: int               #: the device's job number, 1, 2, ... in submission order
    engine: EngineSlot     #: PING or PONG (serial mode: PING)
    phase: Phase
    start: float
    end: float             #: ``inf`` for the compute of a job that never finishes
    tag: JobTag | None     #: who the job was for (the ``tag`` given to ``infer``)
    status: OutputStatus   #: how the job ended

    @property
    def duration(self) -> float:
        return self.end - self.start


@runtime_checkable
class PhaseTimeline(Protocol):
    """The optional part of the driver protocol a device that models its phases offers."""

    def timeline(self) -> Sequence[PhaseSpan] | None:
        """The phases of the last jobs that ended, oldest first; None when this device
        cannot observe its own phases."""
        ...


def phase_timeline(driver: Any) -> tuple[PhaseSpan, ...] | None:
    """``driver.timeline()`` as a tuple, or None when the driver offers none."""
    get = getattr(driver, "timeline", None)
    if get is None:
        return None
    spans = get()
    return None if spans is None else tuple(spans)


def spans_of_job(job: int, engine: int, tag: JobTag | None, status: OutputStatus,
                 phases: Sequence[tuple[float, float]], ended: float) -> list[PhaseSpan]:
    """The spans of one ended job: ``phases`` are the planned ``(start, end)`` of H2D,
    compute and D2H; ``ended`` is when the job ended (its finish time, or the abort)."""
    out = []
    eng = EngineSlot(engine) if engine in (0, 1) else EngineSlot.PING
    for phase, (start, end) in zip(Phase, phases, strict=True):
        if start > ended or (start == ended and end > ended):
            break               # aborted before this phase began
        out.append(PhaseSpan(job, eng, phase, start, min(end, ended), tag, status))
    return out


class JobRing:
    """The last ``capacity`` ended jobs, stored as plain tuples and turned into spans only
    when asked (``capacity`` 0: nothing is kept)."""

    __slots__ = ("_ring",)

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise InvalidArgument(f"timeline capacity must be an integer >= 0, got "
                                  f"{capacity!r}", stage="driver")
        self._ring: deque[tuple] | None = deque(maxlen=capacity) if capacity else None

    @property
    def enabled(self) -> bool:
        return self._ring is not None

    def add(self, job: int, engine: int, tag: JobTag | None, status: OutputStatus,
            phases: tuple[tuple[float, float], ...], ended: float) -> None:
        if self._ring is not None:
            self._ring.append((job, engine, tag, status, phases, ended))

    def spans(self) -> list[PhaseSpan]:
        out: list[PhaseSpan] = []
        for rec in tuple(self._ring or ()):
            out.extend(spans_of_job(*rec))
        return out


def _union(spans: Iterable[PhaseSpan]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted((x.start, x.end) for x in spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def busy_s(spans: Iterable[PhaseSpan]) -> float:
    """Seconds during which at least one of ``spans`` ran."""
    return sum(e - s for s, e in _union(spans))


def overlap_s(a: Iterable[PhaseSpan], b: Iterable[PhaseSpan]) -> float:
    """Seconds during which a span of ``a`` and a span of ``b`` ran at the same time
    (e.g. one job's transfers against the other's compute)."""
    ua, ub = _union(a), _union(b)
    total, i, j = 0.0, 0, 0
    while i < len(ua) and j < len(ub):
        lo = max(ua[i][0], ub[j][0])
        hi = min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo if math.isfinite(hi - lo) else math.inf
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total
