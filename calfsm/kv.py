"""KV admission and transactions: bounded waits, reserve -> submit -> commit, or rollback,
or Unknown (spec section 7).

Theory of operation
-------------------
CalRT 0.7.6's ``KvManager::Apply()`` answers a bare bool, so the old adapter spun on it
forever when the cache was full (S01) and aborted the server when a second apply failed
(S02). The :class:`KvCoordinator` owns the KV manager for one generation and admits
jobs through one FIFO queue guarded by one lock (the spec's ``admission_mu``); each
waiter sleeps on its own condition of that lock, so a change wakes only whom it serves:

- A request is validated first, before any runtime call: lengths (InvalidArgument),
  ``past_len + token_count <= max_seq`` and within uint32 (InvalidArgument; 40960 + one
  decode on ``max_seq`` 40960 is rejected), the deadline (DeadlineExceeded), shutdown
  (Unavailable), the sequence's state (Unknown or already reserved: FailedPrecondition),
  a hole in the KV (``past_len`` above the committed length: InvalidArgument) and a
  reservation larger than the whole token budget (ResourceExhausted).
- Admission is first-come-first-served. Only the head of the queue talks to the
  device: when the token budget has room it asks ``kv_can_allocate(1)`` and then
  ``kv_apply(seq, target)`` once, *without* holding the lock. If either says no, it waits
  until a commit, rollback, mark_unknown, sequence reset, shutdown or
  :meth:`KvCoordinator.wake_all` notifies, or the deadline passes; each wake-up retries
  once and re-checks the deadline (DeadlineExceeded), cancellation (Cancelled) and
  shutdown (Unavailable). A change that lands while the head was calling the device is
  not lost: a version counter makes it retry at once instead of sleeping. No polling.
- No thundering herd: a grant, an end of a reservation, a reset or a waiter leaving
  wakes at most the (new) head, and only when the token budget has room for it; the
  others sleep until they are the head. Their own deadline bounds each sleep, and
  ``wake_all``, ``shutdown`` and ``fence`` wake everyone (to see a cancel, a moved
  virtual clock or the shutdown). ``stats().wakeups`` counts the wake-ups.
- :meth:`KvCoordinator.try_reserve` is the same admission without waiting, for the
  deterministic step scheduler: None when it would have to wait.

A granted :class:`KvReservation` follows the KV machine (:mod:`calfsm.machines.kv`):
``mark_submitted`` after ``infer`` succeeded; ``commit`` after the device finished and
the output checked out (the sequence's committed length becomes ``target_len``);
``rollback`` only from Reserved, i.e. while the device cannot have run the job
(``kv_release(seq, keep_len)`` gives back what the reservation grew); ``mark_unknown``
from Reserved or Submitted when the outcome cannot be proven: the sequence is then
refused until :meth:`KvCoordinator.reset_sequence` (``kv_release(seq, 0)``). An illegal
operation raises :class:`~calfsm.errors.IllegalTransition` from the machine and changes
nothing. Every end of a reservation gives its tokens back to the budget and wakes the
head.

Rewinding: ``past_len`` below the committed length is allowed (a new prompt on a reused
sequence id: the job overwrites positions from ``past_len`` on). ``old_len`` is then
``past_len``; the committed length before the reservation is kept as ``prev_len``. A
commit trims the device allocation to ``target_len`` if it was longer (``kv_release``),
and a rollback keeps ``prev_len`` (the job never ran, nothing was overwritten), so in
the normal case (``past_len`` == committed) rollback releases to ``old_len``.
:meth:`KvCoordinator.truncate_sequence` drops a sequence's tail at once instead
(``kv_release`` to the kept length), so its capacity comes back before the next job.

Capacity invariant (checked by the stateful tests): for every sequence that is not
Unknown, the device allocation is ``max(committed, target of its open reservation)``;
the token budget in use is the sum of the open reservations' tokens and returns to zero
when nothing is open; ``reserved == committed + rolled_back + unknown + open``.

Generations: a coordinator belongs to one generation (the KV manager is rebuilt after
a reset). A reservation of another generation, or of another coordinator, handed to
``mark_submitted``/``commit``/``rollback``/``mark_unknown`` is refused with
:class:`~calfsm.errors.FailedPrecondition` and nothing changes: a stale completion must
never touch the new generation's KV (FI14).

Clocks: deadlines are in the coordinator's ``clock`` time. On a :class:`RealClock` a
waiter's sleep is bounded by the time left. On a virtual clock a blocking
:meth:`~KvCoordinator.reserve` never hangs either: it waits at most the *virtual* time
left, measured in real seconds, and re-reads the virtual clock on every wake-up; whoever
advances a virtual clock while threads wait should call :meth:`~KvCoordinator.wake_all`
so they see their deadline pass. Deterministic step scheduling uses ``try_reserve``.

Runtime calls are never made while holding the lock; machine triggers fire under it
(listeners attached to the KV machine therefore run under the admission lock and must
not call back into the coordinator).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from calfsm.clock import Clock, RealClock
from calfsm.drivers.base import SEQ_LIMIT as _SEQ_LIMIT
from calfsm.drivers.base import U32_MAX as _U32_MAX
from calfsm.drivers.base import Driver
from calfsm.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    from_calrt,
)
from calfsm.lograte import RateLimitedLog
from calfsm.machines.kv import KV_MACHINE, KvState

__all__ = ["KvCoordinator", "KvReservation", "KvState", "KvStats", "SeqState"]

log = logging.getLogger(__name__)
#: the warnings a fault storm repeats, a burst per minute each (calfsm/lograte.py)
_limited = RateLimitedLog(log)

_STAGE = "admission"
#: longest single condition wait (``Condition.wait`` overflows past TIMEOUT_MAX)
_MAX_WAIT_S = min(threading.TIMEOUT_MAX, 3600.0)


class SeqState(enum.StrEnum):
    """What the coordinator knows about one KV sequence."""

    READY = "ready"        #: committed length known, no open reservation
    OPEN = "open"          #: a reservation is open (or being admitted / reset)
    UNKNOWN = "unknown"    #: a job's outcome could not be proven: reset the sequence


@attrs.define(slots=True, eq=False)
class KvReservation:
    """One KV transaction: the sequence grows from ``old_len`` to ``target_len``.

    ``state`` is driven by :data:`calfsm.machines.kv.KV_MACHINE` (``Reserved`` initially);
    change it only through the coordinator's methods.
    """

    seq_id: int
    job_id: int | None
    old_len: int
    target_len: int
    tokens: int
    generation: int
    state: str = KV_MACHINE.initial
    prev_len: int = 0  #: committed length when reserved (== old_len unless rewinding)
    reason: str | None = None  #: why it went Unknown
    _owner: Any = attrs.field(default=None, repr=False, alias="owner")

    @property
    def growth(self) -> int:
        """Positions this reservation added to the device allocation."""
        return max(0, self.target_len - self.prev_len)


@attrs.frozen
class KvStats:
    """A snapshot of the coordinator's books."""

    generation: int
    reserved: int          #: reservations granted, ever
    committed: int
    rolled_back: int
    unknown: int
    open: int              #: granted and not ended
    waiting: int           #: requests in the admission queue
    wakeups: int           #: times a waiter woke from its sleep, ever (notified or timed out)
    budget_used: int
    token_budget: int
    sequences: int         #: sequences with KV or an open reservation
    unknown_sequences: int
    shutdown: bool


@attrs.define(slots=True, eq=False)
class _Seq:
    committed: int = 0
    alloc: int = 0                       #: what we believe the device has allocated
    state: SeqState = SeqState.READY
    open: KvReservation | None = None
    busy: bool = False                   #: being admitted or reset
    reason: str | None = None


@attrs.define(slots=True, eq=False)
class _Waiter:
    seq_id: int
    tokens: int
    #: what it sleeps on (on the admission lock); made at its first wait
    cond: threading.Condition | None = None


class KvCoordinator:
    """Bounded, FIFO KV admission and the KV transactions of one generation."""

    def __init__(self, driver: Driver, *, max_seq: int, token_budget: int,
                 generation: int = 0, clock: Clock | None = None) -> None:
        if max_seq <= 0 or max_seq > _U32_MAX:
            raise InvalidArgument(f"max_seq must be in 1..2**32-1, got {max_seq}",
                                  stage=_STAGE, generation=generation)
        if token_budget <= 0:
            raise InvalidArgument(f"token_budget must be positive, got {token_budget}",
                                  stage=_STAGE, generation=generation)
        self.driver = driver
        self.max_seq = max_seq
        self.token_budget = token_budget
        self.generation = generation
        self.clock: Clock = clock or RealClock()
        self._lock = threading.Lock()
        self._seqs: dict[int, _Seq] = {}
        self._queue: deque[_Waiter] = deque()
        self._version = 0
        self._budget_used = 0
        self._shutdown = False
        self._fenced = False                 #: retired by a reset: never touch the device
        self._n_reserved = 0
        #: reservations ended, by their terminal state (Committed, RolledBack, Unknown)
        self._ended: dict[str, int] = dict.fromkeys(KV_MACHINE.terminal, 0)
        self._n_open = 0
        self._n_wakeups = 0

    # ---- validation -----------------------------------------------------------------------
    def _ctx(self, seq_id: Any, job_id: Any) -> dict[str, Any]:
        return {"seq_id": seq_id if isinstance(seq_id, int) else None, "job_id": job_id,
                "generation": self.generation, "stage": _STAGE}

    def _validate(self, seq_id: int, past_len: int, token_count: int,
                  job_id: int | None) -> int:
        # The error context is built only when a check fails: this runs for every job.
        for what, v in (("seq_id", seq_id), ("past_len", past_len),
                        ("token_count", token_count)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidArgument(f"{what} must be an integer, got {v!r}",
                                      **self._ctx(seq_id, job_id))
        if not 0 <= seq_id < _SEQ_LIMIT:
            raise InvalidArgument(f"seq_id {seq_id} outside 0..2**31-1",
                                  **self._ctx(seq_id, job_id))
        if token_count <= 0:
            raise InvalidArgument(f"token_count must be positive, got {token_count}",
                                  **self._ctx(seq_id, job_id))
        if past_len < 0:
            raise InvalidArgument(f"past_len must not be negative, got {past_len}",
                                  **self._ctx(seq_id, job_id))
        if past_len > _U32_MAX or token_count > _U32_MAX:
            raise InvalidArgument(f"past_len {past_len} / token_count {token_count} beyond "
                                  "uint32", **self._ctx(seq_id, job_id))
        target = past_len + token_count  # Python ints: no overflow; checked below
        if target > _U32_MAX:
            raise InvalidArgument(f"past_len {past_len} + token_count {token_count} = "
                                  f"{target} beyond uint32", **self._ctx(seq_id, job_id))
        if target > self.max_seq:
            raise InvalidArgument(f"past_len {past_len} + token_count {token_count} = "
                                  f"{target} exceeds max_seq {self.max_seq}",
                                  **self._ctx(seq_id, job_id))
        if token_count > self.token_budget:
            raise ResourceExhausted(f"{token_count} tokens exceed the whole token budget "
                                    f"of {self.token_budget}", **self._ctx(seq_id, job_id))
        return target

    def _enqueue_locked(self, seq_id: int, past_len: int, token_count: int,
                        job_id: int | None) -> _Waiter:
        """Stateful admission checks and joining the queue (lock held)."""
        if self._shutdown:
            raise Unavailable("KV coordinator is shut down", **self._ctx(seq_id, job_id))
        seq = self._seqs.get(seq_id)
        if seq is not None:
            if seq.state is SeqState.UNKNOWN:
                raise FailedPrecondition(
                    f"KV of sequence {seq_id} is Unknown ({seq.reason}); reset the sequence "
                    "before using it again", **self._ctx(seq_id, job_id))
            if seq.open is not None or seq.busy:
                raise FailedPrecondition(f"sequence {seq_id} already has an open KV "
                                         "reservation", **self._ctx(seq_id, job_id))
            committed = seq.committed
        else:
            committed = 0
        if past_len > committed:
            raise InvalidArgument(f"past_len {past_len} leaves a hole: sequence {seq_id} "
                                  f"has {committed} committed positions",
                                  **self._ctx(seq_id, job_id))
        if seq is None:
            seq = self._seqs[seq_id] = _Seq()
        seq.busy = True
        w = _Waiter(seq_id, token_count)
        self._queue.append(w)
        return w

    def _leave_locked(self, w: _Waiter) -> None:
        was_head = bool(self._queue) and self._queue[0] is w
        try:
            self._queue.remove(w)
        except ValueError:
            pass
        seq = self._seqs.get(w.seq_id)
        if seq is not None:
            seq.busy = False
            if seq.open is None and seq.alloc == 0 and seq.committed == 0 \
                    and seq.state is SeqState.READY:
                del self._seqs[w.seq_id]
        if was_head:
            self._wake_head_locked()  # pass the head role on: nobody is stranded

    def _wake_head_locked(self) -> None:
        """Something changed that lets the head try: wake it alone, if the token budget
        has room for it (only the head may take capacity, so waking others is waste). A
        head that is not asleep (calling the device) sees the change by the version."""
        if self._queue:
            head = self._queue[0]
            if head.cond is not None and \
                    self._budget_used + head.tokens <= self.token_budget:
                head.cond.notify()

    def _wake_every_locked(self) -> None:
        self._version += 1
        for w in self._queue:
            if w.cond is not None:
                w.cond.notify()

    def _can_try_locked(self, w: _Waiter) -> bool:
        return (bool(self._queue) and self._queue[0] is w
                and self._budget_used + w.tokens <= self.token_budget)

    def _device_grow(self, seq_id: int, target: int) -> bool:
        """Ask the device for room (no lock held): ``canAllocate(1)`` then one ``Apply``.
        Both answer a bool in the driver protocol (CalRT's bare bool): no code to check."""
        return bool(self.driver.kv_can_allocate(1)) and bool(
            self.driver.kv_apply(seq_id, target))

    def _grant_locked(self, w: _Waiter, past_len: int, target: int,
                      job_id: int | None) -> KvReservation:
        seq = self._seqs[w.seq_id]
        self._queue.remove(w)
        seq.busy = False
        r = KvReservation(seq_id=w.seq_id, job_id=job_id, old_len=past_len,
                          target_len=target, tokens=w.tokens, generation=self.generation,
                          prev_len=seq.committed, owner=self)
        seq.open = r
        seq.alloc = max(seq.alloc, target)
        self._budget_used += w.tokens
        self._n_reserved += 1
        self._n_open += 1
        self._wake_head_locked()  # the next waiter is now the head
        return r

    # ---- admission --------------------------------------------------------------------------
    def reserve(self, seq_id: int, past_len: int, token_count: int, deadline: float, *,
                job_id: int | None = None,
                cancelled: Callable[[], bool] | None = None) -> KvReservation:
        """Reserve KV for ``token_count`` tokens after ``past_len``, waiting (FIFO, on a
        condition variable) until the device has room or ``deadline`` (clock time).

        ``cancelled`` is polled at every wake-up (wake waiters with :meth:`wake_all` after
        setting the flag: a waiter that is not the head is woken by nothing else); it is
        called with the admission lock held, so it must be a cheap flag read that takes
        no lock."""
        target = self._validate(seq_id, past_len, token_count, job_id)
        ctx = self._ctx(seq_id, job_id)
        if deadline <= self.clock.now():
            raise DeadlineExceeded("admission deadline already passed", **ctx)
        # On a virtual clock nobody may advance it: bound the wait in real time too.
        real_limit = (time.monotonic() + (deadline - self.clock.now())
                      if getattr(self.clock, "virtual", False) else None)
        lock = self._lock
        with lock:  # held except around the device calls: two lock trips when uncontended
            w = self._enqueue_locked(seq_id, past_len, token_count, job_id)
            try:
                while True:
                    if self._shutdown:
                        raise Unavailable("KV coordinator shut down while waiting", **ctx)
                    if cancelled is not None and cancelled():
                        raise Cancelled("cancelled while waiting for KV", **ctx)
                    if not self._can_try_locked(w):
                        self._wait_locked(w, deadline, real_limit, ctx)
                        continue
                    version = self._version
                    lock.release()
                    try:
                        granted = self._device_grow(seq_id, target)
                    finally:
                        lock.acquire()
                    if granted:
                        return self._grant_locked(w, past_len, target, job_id)
                    if self._version == version:  # nothing changed since we asked
                        self._wait_locked(w, deadline, real_limit, ctx)
            except BaseException:
                self._leave_locked(w)
                raise

    def _wait_locked(self, w: _Waiter, deadline: float, real_limit: float | None,
                     ctx: dict[str, Any]) -> None:
        left = deadline - self.clock.now()
        if real_limit is not None:
            left = min(left, real_limit - time.monotonic())
        if left <= 0:
            raise DeadlineExceeded("no KV capacity before the admission deadline", **ctx)
        if w.cond is None:
            w.cond = threading.Condition(self._lock)
        w.cond.wait(min(left, _MAX_WAIT_S))  # re-checked in the caller's loop
        self._n_wakeups += 1

    def try_reserve(self, seq_id: int, past_len: int, token_count: int, *,
                    job_id: int | None = None) -> KvReservation | None:
        """Reserve now or return None when :meth:`reserve` would have to wait (earlier
        requests queued, token budget short, or the device has no room). Raises for
        everything :meth:`reserve` raises except the deadline."""
        target = self._validate(seq_id, past_len, token_count, job_id)
        with self._lock:
            w = self._enqueue_locked(seq_id, past_len, token_count, job_id)
            if not self._can_try_locked(w):
                self._leave_locked(w)
                return None
        try:
            granted = self._device_grow(seq_id, target)
        except BaseException:
            with self._lock:
                self._leave_locked(w)
            raise
        with self._lock:
            if granted:
                return self._grant_locked(w, past_len, target, job_id)
            self._leave_locked(w)
            return None

    def wake_all(self) -> None:
        """Wake every waiter so it re-checks cancellation, shutdown and its deadline (and
        the head retries the device: call it too when capacity was freed elsewhere)."""
        with self._lock:
            self._wake_every_locked()

    notify = wake_all

    # ---- transactions -------------------------------------------------------------------------
    def _fire_locked(self, r: KvReservation, trigger: str) -> _Seq:
        """Refuse a foreign reservation, let the machine refuse an illegal trigger (both
        before any change), then fire."""
        if r._owner is not self or r.generation != self.generation:
            raise FailedPrecondition(
                f"KV reservation of generation {r.generation} handed to the coordinator of "
                f"generation {self.generation}", seq_id=r.seq_id, job_id=r.job_id,
                generation=r.generation, stage="kv")
        seq = self._seqs.get(r.seq_id)
        if seq is None or seq.open is not r:  # cannot happen through the public API
            KV_MACHINE.require(r, trigger)  # an illegal trigger is named first
            raise FailedPrecondition(f"KV reservation of sequence {r.seq_id} is not open",
                                     seq_id=r.seq_id, job_id=r.job_id,
                                     generation=r.generation, stage="kv")
        KV_MACHINE.fire(r, trigger)  # an illegal trigger raises before any change
        return seq

    def _end_locked(self, r: KvReservation, seq: _Seq) -> None:
        """Close a reservation's books (its state is already terminal)."""
        self._ended[r.state] += 1
        seq.open = None
        self._budget_used -= r.tokens
        self._n_open -= 1
        self._version += 1
        self._wake_head_locked()

    def mark_submitted(self, r: KvReservation) -> None:
        """``infer`` succeeded: from now on the device may have written the KV."""
        with self._lock:
            self._fire_locked(r, "mark_submitted")

    def commit(self, r: KvReservation) -> None:
        """The device finished and the output checked out: the sequence's committed length
        becomes ``target_len``; the tokens go back to the budget. If the device allocation
        was longer (a rewound sequence) it is trimmed with ``kv_release``."""
        with self._lock:
            seq = self._fire_locked(r, "commit")
            seq.committed = r.target_len
            trim = seq.alloc > r.target_len
            if not trim:
                self._end_locked(r, seq)
                return
            seq.busy = True
        self._release_and_end(r, seq, r.target_len, "commit")

    def rollback(self, r: KvReservation) -> None:
        """Undo a reservation whose job the device cannot have run (state Reserved):
        ``kv_release(seq, keep_len)`` gives back what it grew (``keep_len`` is
        ``old_len``, or the committed length for a rewinding reservation)."""
        with self._lock:
            seq = self._fire_locked(r, "rollback")
            seq.busy = True
        self._release_and_end(r, seq, r.prev_len, "rollback")

    def _release_and_end(self, r: KvReservation, seq: _Seq, keep: int, what: str) -> None:
        """Shrink the device allocation to ``keep`` (outside the lock; the sequence is
        marked busy meanwhile), then close the books. A failed release leaves the
        sequence Unknown and raises the classified error."""
        code = self._release(r.seq_id, keep)
        with self._lock:
            seq.busy = False
            seq.alloc = keep
            if code != 0:
                self._to_unknown_locked(seq, f"kv_release on {what} returned {code}")
            self._end_locked(r, seq)
        if code != 0:
            raise from_calrt(code, f"kv_{what}", seq_id=r.seq_id, job_id=r.job_id,
                             generation=r.generation)

    def mark_unknown(self, r: KvReservation, reason: str) -> None:
        """The job's effect on the KV cannot be proven (a failure after submit, or an
        ambiguous submit): the sequence is refused until :meth:`reset_sequence`."""
        with self._lock:
            seq = self._fire_locked(r, "mark_unknown")
            r.reason = reason
            self._to_unknown_locked(seq, reason)
            self._end_locked(r, seq)
        _limited.warning("kv_unknown", "KV of sequence %d is Unknown: %s", r.seq_id, reason,
                         extra={"seq_id": r.seq_id, "job_id": r.job_id,
                           "generation": r.generation, "stage": "kv"})

    def _to_unknown_locked(self, seq: _Seq, reason: str) -> None:
        seq.state = SeqState.UNKNOWN
        seq.reason = reason

    def reset_sequence(self, seq_id: int) -> None:
        """Forget a sequence: ``kv_release(seq, 0)``, committed length 0, state Ready.
        Refused (FailedPrecondition) while a reservation of it is open or admitting. A
        failed release raises the classified error and leaves the sequence Unknown (what
        the device holds for it is not known): reset it again."""
        ctx = {"seq_id": seq_id, "generation": self.generation}
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is not None and (seq.open is not None or seq.busy):
                raise FailedPrecondition(f"sequence {seq_id} has an open KV reservation",
                                         stage="kv_reset", **ctx)
            if seq is None:
                seq = self._seqs[seq_id] = _Seq()
            seq.busy = True
        code = self._release(seq_id, 0)
        with self._lock:
            seq.busy = False
            if code == 0:
                del self._seqs[seq_id]
            else:
                self._to_unknown_locked(seq, f"kv_release on reset returned {code}")
            self._version += 1
            self._wake_head_locked()  # the device may have room now
        if code != 0:
            raise from_calrt(code, "kv_reset", **ctx)

    def truncate_sequence(self, seq_id: int, keep_len: int) -> None:
        """Drop a sequence's positions from ``keep_len`` on: ``kv_release(seq,
        keep_len)``, committed length ``keep_len`` (llama.cpp's ``seq_rm`` of a tail; the
        next job goes on at ``keep_len``). At or past the committed length nothing
        changes; 0 is :meth:`reset_sequence`. Refused (FailedPrecondition) while a
        reservation is open, and for an Unknown sequence (what it holds is not known:
        reset it). A failed release raises the classified error and leaves the sequence
        Unknown."""
        if isinstance(keep_len, bool) or not isinstance(keep_len, int) or keep_len < 0:
            raise InvalidArgument(f"keep_len must be an integer >= 0, got {keep_len!r}",
                                  stage="kv_truncate", seq_id=seq_id,
                                  generation=self.generation)
        if keep_len == 0:
            self.reset_sequence(seq_id)
            return
        ctx = {"seq_id": seq_id, "generation": self.generation, "stage": "kv_truncate"}
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return
            if seq.open is not None or seq.busy:
                raise FailedPrecondition(f"sequence {seq_id} has an open KV reservation",
                                         **ctx)
            if seq.state is SeqState.UNKNOWN:
                raise FailedPrecondition(f"KV of sequence {seq_id} is Unknown ({seq.reason})"
                                         "; reset the sequence instead", **ctx)
            if keep_len >= seq.committed:
                return
            seq.busy = True
        code = self._release(seq_id, keep_len)
        with self._lock:
            seq.busy = False
            if code == 0:
                seq.committed = keep_len
                seq.alloc = min(seq.alloc, keep_len)
            else:
                self._to_unknown_locked(seq, f"kv_release on truncate returned {code}")
            self._version += 1
            self._wake_head_locked()  # the device may have room now
        if code != 0:
            raise from_calrt(code, "kv_truncate", seq_id=seq_id, generation=self.generation)

    def _release(self, seq_id: int, keep_len: int) -> int:
        """``kv_release`` unless fenced: after a reset the device's KV belongs to the new
        generation, so an old reservation's books close without a device call. The code
        is returned, never dropped: both callers close the books and then raise it
        through :func:`~calfsm.errors.from_calrt` (the sequence left Unknown if it was a
        reservation's release)."""
        if self._fenced:
            return 0
        return self.driver.kv_release(seq_id, keep_len)

    def fence(self) -> None:
        """The generation was retired by a reset: shut down, and from now on commit,
        rollback and reset close the books only — no call reaches the device, whose KV
        belongs to the new generation (the FI14 fence for KV)."""
        with self._lock:
            self._fenced = True
        self.shutdown()

    def shutdown(self) -> None:
        """Refuse new reservations and wake every waiter with Unavailable. Open
        reservations can still be committed, rolled back or marked Unknown (drain)."""
        with self._lock:
            self._shutdown = True
            self._wake_every_locked()

    # ---- introspection ----------------------------------------------------------------------
    def sequence_length(self, seq_id: int) -> int:
        """Committed length of a sequence (0 if unknown to the coordinator)."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            return seq.committed if seq else 0

    def sequences(self) -> tuple[int, ...]:
        """Sequences whose KV this coordinator accounts for (held, open or Unknown)."""
        with self._lock:
            return tuple(k for k, v in self._seqs.items()
                         if v.committed or v.alloc or v.open is not None
                         or v.state is SeqState.UNKNOWN)

    def mark_lost(self, seq_ids: Iterable[int], reason: str) -> None:
        """Sequences whose KV the device lost (a reset of an earlier generation): Unknown
        here, so their next job is refused with ``reason`` until the caller resets them,
        instead of silently continuing from an empty cache. No device call."""
        with self._lock:
            for seq_id in seq_ids:
                self._to_unknown_locked(self._seqs.setdefault(seq_id, _Seq()), reason)

    def sequence_state(self, seq_id: int) -> SeqState:
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return SeqState.READY
            if seq.state is SeqState.UNKNOWN:
                return SeqState.UNKNOWN
            return SeqState.OPEN if (seq.open is not None or seq.busy) else SeqState.READY

    def allocation(self, seq_id: int) -> int:
        """What the coordinator believes the device holds for the sequence."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            return seq.alloc if seq else 0

    def open_reservation(self, seq_id: int) -> KvReservation | None:
        with self._lock:
            seq = self._seqs.get(seq_id)
            return seq.open if seq else None

    @property
    def is_shutdown(self) -> bool:
        return self._shutdown

    def stats(self) -> KvStats:
        with self._lock:
            return KvStats(
                generation=self.generation, reserved=self._n_reserved,
                committed=self._ended[KvState.COMMITTED],
                rolled_back=self._ended[KvState.ROLLED_BACK],
                unknown=self._ended[KvState.UNKNOWN], open=self._n_open,
                waiting=len(self._queue), wakeups=self._n_wakeups,
                budget_used=self._budget_used, token_budget=self.token_budget,
                sequences=len(self._seqs),
                unknown_sequences=sum(s.state is SeqState.UNKNOWN
                                      for s in self._seqs.values()),
                shutdown=self._shutdown)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<KvCoordinator gen={s.generation} open={s.open} waiting={s.waiting} "
                f"budget={s.budget_used}/{s.token_budget}>")

