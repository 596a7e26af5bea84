"""What a device step costs: the expectation a hang is judged by, and the measured service
rate admission plans with.

Theory of operation
-------------------
Two numbers describe a step: the time of one decode step and the time per prefilled
token (a prefill of ``n`` tokens costs about ``decode + n * per_token``). The
:class:`ServiceModel` of an executor keeps two versions of them:

- **expected** — what the manifest's ``timing`` says (the vendor's figures; without one,
  :data:`DEFAULT_TIMING`, deliberately slow), raised to what the warm-up golden measured
  when the device turns out slower. It sizes the *execution timeout* that detects a hang
  (:meth:`execution_timeout_s`: ``factor x expected``, never below the floor) and the
  point where ``health()`` suspects one (:meth:`suspect_after_s`, half of that timeout).
  Traffic never lowers or raises it: a device that slowly degrades must not stretch its
  own hang detector, and a burst of fast jobs must not make a slow prefill look hung.
- **measured** — an exponentially weighted mean, over completed jobs, of the time each
  job added: the interval from the later of its joining the submit queue and the
  previous completion to its own completion. With a backlog that is the interval between
  completions (the throughput, which is what a queue drains at), host time between one
  completion and the next submit included: on a busy host that time is not small beside
  a short step, and leaving it out made admission accept bursts that then ran late. With
  two on Ping/Pong it is likewise the interval between completions. Admission plans with
  it (:mod:`calfsm.generate.livestreams`); before the first completion of a kind it is the
  expectation.

Both learn the cost per prefilled token only from prefills whose tokens are expected
(by the manifest) to cost at least one step: a short prefill's excess over a step is the
host's jitter, and extrapolated to a long prompt it turns milliseconds into minutes.

A hang is then caught after about ten expected steps (1 s for a 10 ms decode), well
inside the admission and queue budgets of the jobs waiting behind it (10 s by default),
so those jobs wait for the recovery instead of expiring with the hung one.

The model holds plain floats; :meth:`observe` is called by the completion side only and
the readers tolerate a value one update old, so there is no lock.
"""

from __future__ import annotations

import math

import attrs

from calfsm.errors import InvalidArgument
from calfsm.manifest import Manifest, StepTiming, TaskKind

__all__ = ["DEFAULT_TIMING", "ServiceModel", "WarmupTiming"]

#: the expectation when a manifest names no ``timing``: slow on purpose (a hang is then
#: caught later, but a slow device is never mistaken for a hung one)
DEFAULT_TIMING = StepTiming(decode_ms=50.0, prefill_token_us=500.0)
#: weight of the newest completion in the measured means
_ALPHA = 0.1


@attrs.frozen
class WarmupTiming:
    """What the warm-up golden measured on the driver's clock: one prefill of
    ``prefill_tokens`` tokens and the decode steps after it (seconds each)."""

    prefill_tokens: int
    prefill_s: float
    decode_s: tuple[float, ...]


class ServiceModel:
    """Expected and measured step costs of one executor's device (module docstring)."""

    __slots__ = ("_decode_s", "_factor", "_floor_s", "_last_done", "_measured_decode",
                 "_measured_token", "_token_s", "fixed_timeout_s")

    def __init__(self, timing: StepTiming | None, *, execution_timeout_s: float | None,
                 factor: float = 10.0, floor_s: float = 1.0) -> None:
        for name, value in (("execution_timeout_factor", factor),
                            ("execution_timeout_floor_s", floor_s)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidArgument(f"ExecutorConfig.{name} must be a finite number > 0, "
                                      f"got {value!r}", stage="config")
        timing = timing or DEFAULT_TIMING
        self._decode_s = timing.decode_ms * 1e-3
        self._token_s = timing.prefill_token_us * 1e-6
        self._factor = float(factor)
        self._floor_s = float(floor_s)
        #: the configured execution timeout, or None: derived per job from the expectation
        self.fixed_timeout_s = execution_timeout_s
        self._measured_decode: float | None = None
        self._measured_token: float | None = None
        self._last_done = -math.inf

    @classmethod
    def for_manifest(cls, manifest: Manifest, **kw: float | None) -> ServiceModel:
        return cls(manifest.timing, **kw)  # type: ignore[arg-type]

    # ---- the expectation -----------------------------------------------------------
    def expected_s(self, kind: TaskKind, tokens: int) -> float:
        """How long a step of ``kind`` with ``tokens`` tokens should take on the device."""
        if kind is TaskKind.DECODE:
            return self._decode_s
        return self._decode_s + tokens * self._token_s

    def calibrate(self, warmup: WarmupTiming) -> None:
        """Raise the expectation to what the warm-up measured, if the device is slower
        than the manifest says (never lower it: one fast warm-up proves little), and
        start the measured decode mean from it when nothing was measured yet (the first
        admission estimates then use what a step really took, host included; the
        completions correct it within a few steps; a three-token prefill says too
        little about the cost per token to start that one)."""
        if warmup.decode_s:
            step = max(warmup.decode_s)
            if self._measured_decode is None:
                # what a step costs from the queue includes the host's turn-around, which
                # the manifest's device time leaves out: the warm-up's step, however slow
                # (pessimism costs a few early 429s; optimism would cost 504s)
                self._measured_decode = step
            self._decode_s = max(self._decode_s, step)
        if self._teaches_per_token(warmup.prefill_tokens):
            step = max(warmup.decode_s, default=self._decode_s)
            per_token = max(0.0, warmup.prefill_s - step) / warmup.prefill_tokens
            self._token_s = max(self._token_s, per_token)

    def _teaches_per_token(self, tokens: int) -> bool:
        """Whether a prefill of ``tokens`` says what a token costs: only when its tokens
        are expected to cost at least a step. In a shorter one the host's jitter is the
        whole of the excess: under load a 3-token warm-up 60 ms late priced a token at
        20 ms, and so a 6000-token prompt at two minutes (admission refused it)."""
        return tokens > 0 and tokens * self._token_s >= self._decode_s

    def execution_timeout_s(self, kind: TaskKind, tokens: int, rows: int = 1) -> float:
        """How long ``wait`` may take before the job is given up as hung (FI07). A job
        of ``rows`` rows is given what they would take one after another (a batch step
        never costs more, whatever its rows share)."""
        if self.fixed_timeout_s is not None:
            return self.fixed_timeout_s
        return max(self._floor_s, self._factor * rows * self.expected_s(kind, tokens))

    def suspect_after_s(self, kind: TaskKind, tokens: int) -> float:
        """A job on the device longer than this is a suspected hang (``health()`` stops
        saying ready until it completes or its execution timeout drains the device)."""
        return 0.5 * self.execution_timeout_s(kind, tokens)

    # ---- the measurement -----------------------------------------------------------
    def observe(self, kind: TaskKind, tokens: int, queued: float, done: float) -> None:
        """A job completed: fold the time it added into the measured means (``queued``:
        when it joined the submit queue)."""
        start = queued if queued > self._last_done else self._last_done
        self._last_done = done
        added = done - start
        if not added >= 0.0:
            return
        if kind is TaskKind.DECODE:
            m = self._measured_decode
            self._measured_decode = added if m is None else m + _ALPHA * (added - m)
        elif self._teaches_per_token(tokens):
            per_token = max(0.0, added - self.decode_service_s()) / tokens
            m = self._measured_token
            self._measured_token = per_token if m is None else m + _ALPHA * (per_token - m)

    def decode_service_s(self) -> float:
        """Measured device time a decode step takes from the queue (else expected)."""
        m = self._measured_decode
        return self._decode_s if m is None else m

    def service_s(self, kind: TaskKind, tokens: int) -> float:
        """Measured device time a step of ``kind`` takes from the queue (else expected)."""
        if kind is TaskKind.DECODE:
            return self.decode_service_s()
        m = self._measured_token
        return self.decode_service_s() + tokens * (self._token_s if m is None else m)
