"""KV admission and transactions: reserve -> submit -> commit, or rollback, or Unknown
(spec section 7).

Theory of operation
-------------------
CalRT 0.7.6's ``KvManager::Apply()`` answers a bare bool, so the old adapter spun on it
forever when the cache was full (S01) and aborted the server when a second apply failed
(S02). The :class:`KvCoordinator` owns the KV manager for one generation: its books,
guarded by one lock (the spec's ``admission_mu``), and every call that grows or shrinks
a sequence on the device:

- A request is validated first, before any runtime call: lengths (InvalidArgument),
  ``past_len + token_count <= max_seq`` and within uint32 (InvalidArgument; 40960 + one
  decode on ``max_seq`` 40960 is rejected), shutdown (Unavailable), the sequence's
  state (Unknown or already reserved: FailedPrecondition), a hole in the KV
  (``past_len`` above the committed length: InvalidArgument) and a reservation larger
  than the whole token budget (ResourceExhausted).
- Admission never waits here: :meth:`KvCoordinator.try_reserve` grants now or answers
  None (the token budget is short, the device has no room, or another admission is
  talking to the device). Only one admission talks to the device at a time: when the
  token budget has room it asks ``kv_can_allocate(1)`` and then ``kv_apply(seq,
  target)`` once, *without* holding the lock. Who waits, in what order and until when is
  the executor's admission queue (:mod:`calfsm.engine.admission`): one queue for every job, so
  these books keep no waiters, read no clock and never sleep.
- Whatever may let a refused admission through — the end of a reservation, a sequence
  reset or truncated, a refused grow given up — calls ``on_freed()`` (set by the owner;
  no lock held), so the admission queue tries again then and not before. A grow the
  device refused calls ``on_full()`` (no lock held): the owner may release KV nobody is
  using (the prompt cache's sequences), which calls ``on_freed()`` in turn.

A granted :class:`KvReservation` follows the KV machine (:mod:`calfsm.machines.kv`):
``mark_submitted`` after ``infer`` succeeded; ``commit`` after the device finished and
the output checked out (the sequence's committed length becomes ``target_len``);
``rollback`` only from Reserved, i.e. while the device cannot have run the job
(``kv_release(seq, keep_len)`` gives back what the reservation grew); ``mark_unknown``
from Reserved or Submitted when the outcome cannot be proven: the sequence is then
refused until :meth:`KvCoordinator.reset_sequence` (``kv_release(seq, 0)``). An illegal
operation raises :class:`~calfsm.errors.IllegalTransition` from the machine and changes
nothing. Every end of a reservation gives its tokens back to the budget (and calls
``on_freed``).

Rewinding: ``past_len`` below the committed length is allowed (a new prompt on a reused
sequence id: the job overwrites positions from ``past_len`` on). ``old_len`` is then
``past_len``; the committed length before the reservation is kept as ``prev_len``. A
commit trims the device allocation to ``target_len`` if it was longer (``kv_release``),
and a rollback keeps ``prev_len`` (the job never ran, nothing was overwritten), so in
the normal case (``past_len`` == committed) rollback releases to ``old_len``.
:meth:`KvCoordinator.truncate_sequence` drops a sequence's tail at once instead
(``kv_release`` to the kept length), so its capacity comes back before the next job.

Chained reservations: a stream's next step may be reserved while the step before it
still runs (``try_reserve(..., chain=True)``: the sequence's open reservation ends where
the new one begins). At most one is chained per sequence; it commits only after the one
before it (it becomes the open one then), and ends with it when that one rolls back or
goes Unknown. So nothing on a token's way waits for its predecessor's commit.

Capacity invariant (checked by the stateful tests): for every sequence that is not
Unknown, the device allocation is ``max(committed, target of its open reservation,
target of the one chained after it)``;
the token budget in use is the sum of the open reservations' tokens and returns to zero
when nothing is open; ``reserved == committed + rolled_back + unknown + open``.

Generations: a coordinator belongs to one generation (the KV manager is rebuilt after
a reset). A reservation of another generation, or of another coordinator, handed to
``mark_submitted``/``commit``/``rollback``/``mark_unknown`` is refused with
:class:`~calfsm.errors.FailedPrecondition` and nothing changes: a stale completion must
never touch the new generation's KV (FI14).

Runtime calls are never made while holding the lock; machine triggers fire under it
(listeners attached to the KV machine therefore run under the admission lock and must
not call back into the coordinator).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from calfsm.drivers.base import SEQ_LIMIT as _SEQ_LIMIT
from calfsm.drivers.base import U32_MAX as _U32_MAX
from calfsm.drivers.base import Driver
from calfsm.engine.sync import Sync
from calfsm.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    from_calrt,
)
from calfsm.machines.kv import KV_MACHINE, KvState
from calfsm.util.lograte import RateLimitedLog

__all__ = ["KvCoordinator", "KvReservation", "KvState", "KvStats", "SeqState"]

log = logging.getLogger(__name__)
#: the warnings a fault storm repeats, a burst per minute each (calfsm/util/lograte.py)
_limited = RateLimitedLog(log)

_STAGE = "admission"
#: the states of a reservation another may be chained after
_CHAINABLE = (KvState.RESERVED, KvState.SUBMITTED)


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
    #: the reservation chained after ``open`` (the next step, reserved while it runs)
    next: KvReservation | None = None
    busy: bool = False                   #: being admitted or reset
    reason: str | None = None


class KvCoordinator:
    """The KV books and transactions of one generation: reservations granted now or
    refused, never waited for."""

    def __init__(self, driver: Driver, *, max_seq: int, token_budget: int,
                 sync: Sync, generation: int = 0) -> None:
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
        #: called (no lock held) when capacity may have come free for a refused
        #: admission: the owner's admission queue tries again
        self.on_freed: Callable[[], None] | None = None
        #: called (no lock held) when the device refused room for a reservation: the
        #: owner may release KV nobody is using (the prompt cache), whose release then
        #: calls ``on_freed``
        self.on_full: Callable[[], None] | None = None
        self._lock = sync.lock()
        self._seqs: dict[int, _Seq] = {}
        self._asking = False                 #: an admission is calling the device
        self._turned_away = False            #: one was refused meanwhile
        self._budget_used = 0
        self._shutdown = False
        self._fenced = False                 #: retired by a reset: never touch the device
        self._n_reserved = 0
        #: reservations ended, by their terminal state (Committed, RolledBack, Unknown)
        self._ended: dict[str, int] = dict.fromkeys(KV_MACHINE.terminal, 0)
        self._n_open = 0

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

    def _check_locked(self, seq_id: int, past_len: int, job_id: int | None,
                      chain: bool) -> KvReservation | None:
        """The stateful admission checks (lock held). Returns the open reservation the
        new one is chained after (``chain``, and it ends exactly at ``past_len``)."""
        if self._shutdown:
            raise Unavailable("KV coordinator is shut down", **self._ctx(seq_id, job_id))
        seq = self._seqs.get(seq_id)
        if seq is not None:
            if seq.state is SeqState.UNKNOWN:
                raise FailedPrecondition(
                    f"KV of sequence {seq_id} is Unknown ({seq.reason}); reset the sequence "
                    "before using it again", **self._ctx(seq_id, job_id))
            before = seq.open
            if chain and before is not None and seq.next is None and not seq.busy \
                    and before.target_len == past_len and before.state in _CHAINABLE:
                return before
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
        return None

    def _done_asking_locked(self, seq_id: int) -> bool:
        """The device call of an admission is over; True if one was turned away
        meanwhile (it may try again now)."""
        self._asking = False
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.busy = False
            if seq.open is None and seq.alloc == 0 and seq.committed == 0 \
                    and seq.state is SeqState.READY:
                del self._seqs[seq_id]
        turned_away, self._turned_away = self._turned_away, False
        return turned_away

    def _freed(self) -> None:
        """Tell the owner capacity may have come free (never with the lock held)."""
        hook = self.on_freed
        if hook is not None:
            hook()

    def _device_grow(self, seq_id: int, target: int) -> bool:
        """Ask the device for room (no lock held): ``canAllocate(1)`` then one ``Apply``.
        Both answer a bool in the driver protocol (CalRT's bare bool): no code to check."""
        return bool(self.driver.kv_can_allocate(1)) and bool(
            self.driver.kv_apply(seq_id, target))

    def _grant_locked(self, seq_id: int, past_len: int, target: int, token_count: int,
                      job_id: int | None, after: KvReservation | None
                      ) -> KvReservation | None:
        seq = self._seqs[seq_id]
        seq.alloc = max(seq.alloc, target)
        if after is not None and seq.open is not after and not (
                seq.open is None and after.state == KvState.COMMITTED):
            # the reservation it follows ended otherwise while the device grew the
            # sequence: what the device now holds for it is not known
            if seq.state is not SeqState.UNKNOWN:
                self._to_unknown_locked(seq, "a chained reservation raced the end of the "
                                        "one before it")
            return None
        # chained after a reservation still open, it rolls back to where that one ends
        r = KvReservation(seq_id=seq_id, job_id=job_id, old_len=past_len,
                          target_len=target, tokens=token_count, generation=self.generation,
                          prev_len=past_len if after is not None else seq.committed,
                          owner=self)
        if seq.open is None:
            seq.open = r
        else:
            seq.next = r
        self._budget_used += token_count
        self._n_reserved += 1
        self._n_open += 1
        return r

    # ---- admission ----------------------------------------------------------------------
    def try_reserve(self, seq_id: int, past_len: int, token_count: int, *,
                    job_id: int | None = None, chain: bool = False
                    ) -> KvReservation | None:
        """Reserve KV for ``token_count`` tokens after ``past_len`` now, or return None:
        the token budget is short, the device has no room, or another admission is
        calling the device (``on_freed`` follows whatever may change that). Raises for a
        bad request, a sequence that cannot take one, or a shut-down coordinator.

        ``chain``: the sequence's open reservation may still be running if it ends at
        ``past_len`` (a stream's next step, reserved while the step before it runs): the
        new one is chained after it, becomes the open one when it commits, and ends with
        it if it ends any other way (rolled back or Unknown). One chained at a time."""
        target = self._validate(seq_id, past_len, token_count, job_id)
        with self._lock:
            after = self._check_locked(seq_id, past_len, job_id, chain)
            if self._asking:
                self._turned_away = True
                return None
            if self._budget_used + token_count > self.token_budget:
                return None
            self._asking = True
            self._seqs.setdefault(seq_id, _Seq()).busy = True
        granted = False
        try:
            granted = self._device_grow(seq_id, target)
        finally:
            with self._lock:
                r = self._grant_locked(seq_id, past_len, target, token_count, job_id,
                                       after) if granted else None
                retry = self._done_asking_locked(seq_id)
            if retry:
                self._freed()
        if not granted:         # refused (a raise above never gets here)
            hook = self.on_full
            if hook is not None:
                hook()
        return r

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
        if seq is None or (seq.open is not r and seq.next is not r):  # not via the API
            KV_MACHINE.require(r, trigger)  # an illegal trigger is named first
            raise FailedPrecondition(f"KV reservation of sequence {r.seq_id} is not open",
                                     seq_id=r.seq_id, job_id=r.job_id,
                                     generation=r.generation, stage="kv")
        if trigger == "commit" and seq.next is r:
            raise FailedPrecondition(
                f"KV reservation of sequence {r.seq_id} at {r.old_len} commits after the one "
                "before it", seq_id=r.seq_id, job_id=r.job_id, generation=r.generation,
                stage="kv")
        KV_MACHINE.fire(r, trigger)  # an illegal trigger raises before any change
        return seq

    def _end_locked(self, r: KvReservation, seq: _Seq) -> None:
        """Close a reservation's books (its state is already terminal)."""
        self._ended[r.state] += 1
        if seq.open is r:
            seq.open, seq.next = seq.next, None     # the chained one is the open one now
        else:
            seq.next = None
        self._budget_used -= r.tokens
        self._n_open -= 1

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
            keep = r.target_len if seq.next is None else seq.next.target_len
            trim = seq.alloc > keep
            if trim:
                seq.busy = True
            else:
                self._end_locked(r, seq)
        if trim:
            self._release_and_end(r, seq, keep, "commit")
        else:
            self._freed()

    def rollback(self, r: KvReservation) -> None:
        """Undo a reservation whose job the device cannot have run (state Reserved):
        ``kv_release(seq, keep_len)`` gives back what it grew (``keep_len`` is
        ``old_len``, or the committed length for a rewinding reservation). A
        reservation chained after it is rolled back with it (it could only follow);
        a chained one rolled back alone gives back to where the one before it ends."""
        with self._lock:
            seq = self._seqs.get(r.seq_id)
            chained = seq is not None and seq.next is r
            after = seq.next if seq is not None and seq.open is r else None
            if after is not None:
                KV_MACHINE.require(after, "rollback")   # refused before any change
            seq = self._fire_locked(r, "rollback")
            if after is not None:
                KV_MACHINE.fire(after, "rollback")
                self._end_locked(after, seq)
            if chained:             # off the books now: the one before it goes on
                self._end_locked(r, seq)
            seq.busy = True
        self._release_and_end(r, seq, r.prev_len, "rollback", ended=chained)

    def _release_and_end(self, r: KvReservation, seq: _Seq, keep: int, what: str, *,
                         ended: bool = False) -> None:
        """Shrink the device allocation to ``keep`` (outside the lock; the sequence is
        marked busy meanwhile), then close the books (unless ``ended`` already). A
        failed release leaves the sequence Unknown and raises the classified error."""
        code = self._release(r.seq_id, keep)
        with self._lock:
            seq.busy = False
            seq.alloc = keep
            if code != 0:
                self._to_unknown_locked(seq, f"kv_release on {what} returned {code}")
            if not ended:
                self._end_locked(r, seq)
        self._freed()
        if code != 0:
            raise from_calrt(code, f"kv_{what}", seq_id=r.seq_id, job_id=r.job_id,
                             generation=r.generation)

    def mark_unknown(self, r: KvReservation, reason: str) -> None:
        """The job's effect on the KV cannot be proven (a failure after submit, or an
        ambiguous submit): the sequence is refused until :meth:`reset_sequence`."""
        with self._lock:
            seq = self._seqs.get(r.seq_id)
            after = seq.next if seq is not None and seq.open is r else None
            seq = self._fire_locked(r, "mark_unknown")
            r.reason = reason
            self._to_unknown_locked(seq, reason)
            if after is not None:       # chained after it: it cannot go on either
                KV_MACHINE.fire(after, "mark_unknown")
                after.reason = reason
                self._end_locked(after, seq)
            self._end_locked(r, seq)
        self._freed()
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
        self._freed()                   # the device may have room now
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
        self._freed()                   # the device may have room now
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
        """Refuse new reservations (Unavailable). Open reservations can still be
        committed, rolled back or marked Unknown (drain)."""
        with self._lock:
            self._shutdown = True

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

    def chained_reservation(self, seq_id: int) -> KvReservation | None:
        """The reservation chained after the open one (the next step), if any."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            return seq.next if seq else None

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
                budget_used=self._budget_used, token_budget=self.token_budget,
                sequences=len(self._seqs),
                unknown_sequences=sum(s.state is SeqState.UNKNOWN
                                      for s in self._seqs.values()),
                shutdown=self._shutdown)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<KvCoordinator gen={s.generation} open={s.open} "
                f"budget={s.budget_used}/{s.token_budget}>")

