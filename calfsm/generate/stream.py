"""Generation streams: the library owns a request's whole life, on a sequence
(:mod:`calfsm.generate.sequence`).

Theory of operation
-------------------
:class:`Stream` generates tokens on a sequence: a prefill of the prompt, then one decode
per token, each sampled (:mod:`calfsm.generate.sampling`: the logits processors, and logprobs
into the token's event, when the params ask for them) from the float32 row of the job
before. It is driven by job completions: each step's job carries the stream's continuation,
which the completion side runs once the output is checked and the KV committed, before
the job resolves: it samples, records the token, and hands the next decode (prepared
ahead by the stream's :class:`~calfsm.generate.flow.Flow`) to the submitter. The job's
done-callback (holding no lock) then wakes the consumer, or ends the stream, or enqueues
a next decode that was not prepared without blocking (``enqueue_nowait``: a job that must
wait for KV or a buffer is parked, holding no thread). The consumer reads events as a sync
iterator, an async iterator, or waits for the final :class:`GenerationResult`;
``cancel()`` stops it (a step on the device runs to its end and its token is dropped).

Finish reasons: ``length`` (``max_tokens``, which must fit the context:
:mod:`calfsm.generate.arguments`), ``stop`` (a stop token, a stop sequence or a stop string; none
is delivered), ``cancelled``, ``deadline`` (the stream's deadline, checked after every
step, and each step's own deadline), ``error`` (any other error; ``result().error`` has
it, with ``retryable`` saying whether sending it again may help).

Text: on an executor with a tokenizer (:mod:`calfsm.generate.tokenizer`), a stream decodes its
tokens one at a time: each event carries the ``text`` it delivers and the result all of
it. Stop strings (``SamplingParams.stop``) are matched on that text
(:mod:`calfsm.generate.stopstrings`); the tokens whose text may begin one are held back, as the
tokens that may begin a stop sequence are. Without a tokenizer and without stop
sequences, a token is delivered at once, at the cost of one branch, as before.

Resume: when a reset loses the sequence's KV mid-stream, a stream with ``resume=True``
(the default) waits for the executor to be Ready again, resets the sequence and
re-prefills the prompt plus the tokens generated so far on the new generation, then
continues; under greedy sampling it checks that the replay reproduces the last delivered
token. Replays are bounded per stream (``max_resumes``) and start only once the device
is Ready, so a recovery storm is not amplified. Without resume the stream ends ``error``
with a retryable :class:`~calfsm.errors.Unavailable`.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import threading
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np

from calfsm.engine.job import JobContext, JobHandle, Successor, drop_tracebacks
from calfsm.engine.results import FinishReason, GenerationResult, TokenEvent, Usage
from calfsm.errors import (
    CalfsmError,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    Internal,
    InvalidArgument,
    Unavailable,
)
from calfsm.generate.arguments import (
    ContextLimits,
    check_max_tokens,
    check_prompt,
    default_params,
)
from calfsm.generate.constraint import compile_constraint
from calfsm.generate.flow import Flow
from calfsm.generate.front import Front
from calfsm.generate.livestreams import stream_work_s
from calfsm.generate.processors import TokenHistory
from calfsm.generate.sampling import Sampler, SamplingParams
from calfsm.generate.stopstrings import StopStrings
from calfsm.generate.tokenizer import IncrementalDecoder, encode_prompt, incremental_decoder
from calfsm.machines.sequence import SequenceState
from calfsm.manifest import TaskKind
from calfsm.request import Request
from calfsm.util.lazy import asyncio_module
from calfsm.util.lograte import RateLimitedLog

if TYPE_CHECKING:
    import asyncio

__all__ = ["FinishReason", "GenerationResult", "Keeper", "Stream", "StreamSequence",
           "TokenEvent", "Usage"]

log = logging.getLogger("calfsm.streams")
#: a stream without a deadline of its own (its steps then get none: no call to say so)
_NO_DEADLINE = math.inf
#: the warnings a fault storm repeats, a burst per minute each (calfsm/util/lograte.py)
_limited = RateLimitedLog(log)


class StreamSequence(Protocol):
    """What a stream uses of the sequence it generates on
    (:class:`~calfsm.generate.sequence.Sequence` is one): its jobs, the staging of its
    next step (through its :class:`~calfsm.generate.flow.Flow`), its reset and release."""

    seq_id: int
    state: str
    #: what the executor's sequences and streams share (calfsm/generate/front.py)
    front: Front

    @property
    def position(self) -> int: ...

    def run(self, request: Request, *, continuing: bool = False) -> JobHandle: ...

    def stage(self, request: Request) -> JobHandle | None: ...

    def discard(self, staged: JobHandle) -> None: ...

    def defer(self, fn: Callable[[], None]) -> None: ...

    def release(self, staged: JobHandle, request: Request) -> JobHandle | None: ...

    def follow(self, staged: JobHandle, *, after: JobHandle) -> bool: ...

    def idle(self) -> bool: ...

    def when_idle(self, fn: Callable[[], None]) -> None: ...

    def reset(self) -> None: ...

    def close_when_done(self) -> None: ...


class Keeper(Protocol):
    """Who takes a one-shot stream's sequence when the stream ends, instead of its being
    released (:class:`~calfsm.generate.promptcache.PromptCache` is one): handed the sequence once
    no job of it is left running, and the stream's prompt and drawn tokens, of which its
    KV holds the first ``sequence.position``. It keeps the sequence or releases it."""

    def keep(self, sequence: StreamSequence, tokens: tuple[int, ...]) -> None: ...


def _tail_row(stream: Stream, job: JobContext) -> Any:
    """The stream's sampler's row of the completion's native tail for ``job``'s token
    (calfsm/engine/tail.py), or None: :meth:`Stream._decide` samples. Not for a replay
    (it draws nothing) nor a cancelled stream."""
    if stream._cancelled or stream._flow.replay_check is not None:
        return None
    row = stream._tail
    if row is not None:
        return row
    sampler = stream._sampler
    if sampler.uses_tokens:
        return sampler.tail_row(TokenHistory(stream.prompt, stream._tokens))
    row = stream._tail = sampler.tail_row()     # the same every step: asked for once
    return row


class Stream:
    """Tokens of one generation: a sync and an async iterator of :class:`TokenEvent`,
    ``cancel()``, and ``result()`` / ``await stream.final()``. ``request_id`` names it
    in the executor (given, else generated): its steps, errors, log lines and observer
    events carry it, and ``executor.abort(request_id)`` cancels it.

    ``close_sequence``: the sequence is the stream's own (a one-shot ``generate``):
    released when the stream ends, or handed to ``keeper`` (the prompt cache).
    ``cached``: the sequence's KV already ends with the first ``cached`` prompt tokens (a
    prompt cache hit): only the rest is prefilled, and the stream's history still begins
    where that prefix does (a resume replays all of it).

    ``priority`` (:attr:`calfsm.request.Request.priority`) is every step's: the prefill,
    each decode and a replay wait for admission at the stream's priority, each aged from
    its own acceptance (docs/architecture.md, Admission)."""

    #: the sampler's row of the native tail, when it reads no tokens (else asked for at
    #: every step: :func:`_tail_row`)
    _tail: Any = None
    #: the consumer was woken once: a first token is woken as it is recorded, before
    #: its next step is submitted, every later one after (:meth:`_record`)
    _woke = False

    def __init__(self, sequence: StreamSequence, prompt: Seq[int] | str,
                 params: SamplingParams | None, *,
                 deadline_s: float | None = None, resume: bool = True, max_resumes: int = 2,
                 close_sequence: bool = False, admitted: bool = False,
                 request_id: str | None = None, parent: str | None = None, priority: int = 0,
                 keeper: Keeper | None = None, cached: int = 0,
                 arrival: float | None = None) -> None:
        ex, seq_id = sequence.front, sequence.seq_id
        epoch = ex.epoch
        if epoch is None:
            raise Unavailable("executor has no configured model", stage="generate")
        contract, tokenizer = epoch.contract(TaskKind.DECODE), ex.tokenizer
        self.sequence = sequence
        checked, params = judge_stream(prompt, params, tokenizer, priority, epoch.model,
                                       position=sequence.position - cached, seq_id=seq_id)
        self.prompt = tuple(checked.tokens.tolist())
        #: every step's admission priority (checked with the prompt)
        self.priority: int = checked.priority
        _check_options(deadline_s, max_resumes, cached,
                       min(sequence.position, len(self.prompt) - 1), sequence.seq_id)
        #: prompt tokens whose KV the sequence already held (a prompt cache hit)
        self.cached = cached
        self.params = params
        self._sampler: Sampler = params.sampler_for(
            contract.vocab, prompt_len=len(self.prompt),
            eos_token_id=getattr(tokenizer, "eos_token_id", None), tokenizer=tokenizer)
        self._max_seq = contract.max_seq
        self._clock = ex.clock
        now = self._clock.now()
        self.arrival = _arrival(arrival, now, seq_id)   #: when its request arrived
        self._deadline = now + deadline_s if deadline_s is not None else _NO_DEADLINE
        #: where the stream's own history (its prompt, then its tokens) begins
        self._start = sequence.position - cached
        self._max_new = max_new_tokens(params, self._max_seq, self._start, len(self.prompt))
        if not admitted:    # refused now (429) if it, or one it would slow, cannot end in time
            ex.live_streams.admit(prompt_tokens=len(self.prompt) - cached,
                                  max_new=self._max_new, deadline=self._deadline,
                                  seq_id=sequence.seq_id)
        self._close_sequence = close_sequence
        self._keeper = keeper if close_sequence else None
        self._t0 = now
        self._lock = threading.Condition(threading.Lock())
        #: the next step: in flight, prepared ahead, rows, replay and resume budget
        self._flow = Flow(sequence, self._lock, seq_id=sequence.seq_id,
                          vocab=contract.vocab, resume=resume, max_resumes=max_resumes)
        self._new_books()
        #: the text of the tokens (None without a tokenizer)
        self._text = None if tokenizer is None else StreamText(tokenizer, params.stop, seq_id)
        #: a token is delivered at once, with no text: the one branch of the hot path
        self._plain = tokenizer is None and not params.holds_back
        #: this stream's id in the executor (calfsm/generate/liverequests.py)
        self.request_id: str = ex.live_requests.add(request_id, "stream", self, parent=parent)
        self.parent_id = parent             #: the id grouping it with others (n > 1), or None
        first = Request.prefill(sequence.seq_id, checked.tokens[cached:].copy(),
                                past_len=sequence.position, target=self._flow.row(),
                                deadline_s=self._left(), request_id=self.request_id,
                                priority=self.priority)
        ex.live_streams.add(self)
        ex.observers.stream_started(self)
        self._submit(first, continuing=False)

    def _new_books(self) -> None:
        """What the stream records from its first token to its end, empty."""
        self._tokens: list[int] = []
        self._times: list[float] = []
        self._events: deque[TokenEvent] = deque()
        #: events held back: their tokens, or their text, may begin a stop sequence or a
        #: stop string (not yet delivered)
        self._held: list[TokenEvent] = []
        self._delivered = 0             # tokens given to the consumer (queued events too)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._result: GenerationResult | None = None
        self._cancelled = False
        self._listening = False
        #: what the continuation of the step in flight decided: (its job id, outcome)
        self._decided: tuple[int, _Outcome] | None = None
        self._ending = False            # _finish has begun: nothing more is recorded

    @property
    def flow_state(self) -> str:
        """The state of the stream's flow (:class:`~calfsm.machines.flow.FlowState`)."""
        return self._flow.state

    def describe(self) -> tuple[str, int]:
        """Its state (the flow's; the step in flight's too, as ``flow/job``) and the
        tokens it has made so far, for ``executor.requests()``."""
        handle = self._flow.inflight
        state = self._flow.state if handle is None or handle.done() \
            else f"{self._flow.state}/{handle.state}"
        return state, len(self._tokens)

    @property
    def started(self) -> float:
        """When the stream was created (the driver's clock). ``ttft_s`` counts from
        :attr:`arrival`: when its request arrived (``generate(arrival=...)``, a server's
        read of it, where a client's clock starts), else this."""
        return self._t0

    # ---- consumer side -------------------------------------------------------------
    def cancel(self) -> bool:
        """Stop generating: nothing more is delivered; a step on the device runs to its
        end. False if the stream had already finished."""
        with self._lock:
            if self._ending:
                return False
            self._cancelled = True
            self._flow.stopping = True
            handle = self._flow.inflight
            waiting = self._listening or handle is None or handle.done()
        if handle is not None:
            handle.cancel()
        if waiting:                 # no step runs (it waits to resume): end it now
            self._finish(FinishReason.CANCELLED)
        return True

    def abort(self, error: CalfsmError) -> bool:
        """End the stream now with finish reason ``error`` and ``error`` (what a
        shutdown does to the streams it has to cut); otherwise as :meth:`cancel`:
        nothing more is delivered, a step on the device runs to its end. False if the
        stream had already finished."""
        with self._lock:
            if self._ending:
                return False
            cancelled = self._cancelled     # the consumer's cancel came first: it stands
            self._cancelled = True
            self._flow.stopping = True
            handle = self._flow.inflight
        # ended first, then the step cancelled: the step's own end (cancelled before
        # submit) must not become the stream's reason
        if cancelled:
            self._finish(FinishReason.CANCELLED)
        else:
            self._finish(FinishReason.ERROR, error)
        if handle is not None:
            handle.cancel()
        return True

    def remaining_work(self, service: Any) -> tuple[float, float]:
        """(device seconds this stream still needs at most, its deadline as clock time),
        costed with ``service`` (a :class:`~calfsm.engine.stepcost.ServiceModel`): what the
        admission estimate of a new stream weighs it by."""
        done = len(self._tokens)
        return stream_work_s(service, prompt_tokens=len(self.prompt) - self.cached,
                             left=max(0, self._max_new - done), prefilled=done > 0), \
            self._deadline

    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the stream ends; its result (never raises for a failed stream:
        ``result().error`` holds the error)."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._result is not None, timeout):
                raise DeadlineExceeded(f"stream not finished within {timeout} s",
                                       seq_id=self.sequence.seq_id, stage="result")
            return self._result

    async def final(self) -> GenerationResult:
        """The result, awaited without blocking the event loop."""
        while True:
            with self._lock:
                if self._result is not None:
                    return self._result
                fut = self._park()
            await self._await(fut)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> TokenEvent:
        with self._lock:
            if not self._events and self._result is None:
                self._lock.wait_for(lambda: self._events or self._result is not None)
            if self._events:
                return self._events.popleft()
            raise StopIteration

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> TokenEvent:
        while True:
            with self._lock:
                if self._events:
                    return self._events.popleft()
                if self._result is not None:
                    raise StopAsyncIteration
                fut = self._park()
            await self._await(fut)

    def _park(self) -> asyncio.Future:
        loop = asyncio_module().get_running_loop()
        fut = loop.create_future()
        self._waiters.append((loop, fut))
        return fut

    async def _await(self, fut: asyncio.Future) -> None:
        try:
            await fut
        except asyncio_module().CancelledError:
            self.cancel()               # the consumer went away: so does the stream
            raise

    # ---- producer side (job completions) -------------------------------------------
    def _left(self) -> float | None:
        """The seconds left to the stream's deadline, or None: it has none."""
        if self._deadline == _NO_DEADLINE:
            return None
        return max(1e-9, self._deadline - self._clock.now())

    def _submit(self, request: Request, staged: JobHandle | None = None, *,
                continuing: bool = True) -> None:
        """Run the next step: the staged one with its real request if there is one, else
        the ordinary way; then prepare the step after it (deferred, off this thread).
        ``continuing``: every step but the stream's first is the stream's own going on
        (not new work for ``max_waiting`` or a graceful shutdown)."""
        handle = None
        if staged is not None:
            handle = self.sequence.release(staged, request)
        if handle is None:
            try:
                handle = self.sequence.run(request, continuing=continuing)
            except CalfsmError as e:
                self._on_error(e)
                return
        self._started(handle, request)

    def _started(self, handle: JobHandle, request: Request) -> None:
        """``handle`` runs ``request``, the stream's step in flight now: it carries the
        stream's continuation, and the step after it is prepared (deferred)."""
        then = _off_path(self, self._track(handle, request))
        if then is not None:
            self.sequence.defer(then)

    def _track(self, handle: JobHandle, request: Request) -> bool:
        """Make ``handle`` (running ``request``) the step in flight: it carries the
        stream's continuation and its end is the stream's. Whether the step after it
        is worth preparing ahead."""
        handle.context.continuation = self._continue
        if self._sampler.tail_capable:  # its token in the completion's native call
            handle.context.tail = functools.partial(_tail_row, self)
        with self._lock:
            self._flow.handed_on(handle, request)
            cancelled = self._cancelled
        if cancelled:
            handle.cancel()
        handle.add_done_callback(self._step_done)
        # worth it if another decode may follow the step in flight
        return not cancelled and len(self._tokens) + 1 < self.params.max_tokens \
            and self._flow.next_pos < self._max_seq

    def _stage_next(self) -> None:
        """Prepare the decode that will carry the in-flight step's token."""
        timed = self._deadline != _NO_DEADLINE
        self._flow.stage_next(deadline_s=self._left() if timed else None,
                              priority=self.priority,
                              request_id=self.request_id)
        if self._sampler.constrained:
            _prepare_mask(self)

    # ---- a step's end: decide (on the completion side), then deliver ---------------
    def _continue(self, job: JobContext, logits: np.ndarray) -> Successor | None:
        """The job's continuation (see :class:`~calfsm.engine.job.JobContext`): its output is
        checked (its KV commits right after) and its handle not yet resolved. Decide
        what follows; when the next decode was prepared ahead, return it with its token
        for the core to run now, before the job's callbacks. It calls nothing of the
        executor: what is left (waking the consumer, an ending, a next step that must
        go the ordinary way) happens in :meth:`_step_done`."""
        successor = None
        try:
            tailed, job.tailed = job.tailed, None
            outcome = self._decide(logits, job.timings, job.past_len + job.token_count,
                                   chain=job.handle, tailed=tailed)
        except Exception as e:          # a bug: the stream ends, nobody is left waiting
            outcome = (FinishReason.ERROR, self._bug(e), None)
        if isinstance(outcome[2], Successor):
            successor, outcome = outcome[2], _GOES_ON
        with self._lock:
            self._decided = (job.job_id, outcome)
        return successor

    def _step_done(self, handle: JobHandle) -> None:
        # the job holds the stream through its continuation: let go, however it ended
        # (a sequence keeps its last job; the stream must not live on through it). The
        # continuation is set once the job exists, so only this callback, which runs for
        # every end, even one before the continuation was set, can clear it every time
        handle.context.continuation = None
        handle.context.tail = None
        try:
            with self._lock:
                # only this job's own decision: a step that ended first (its successor,
                # failed at submit before this job resolved) must not take it
                decided = self._decided
                outcome = None
                if decided is not None and decided[0] == handle.job_id:
                    self._decided, outcome = None, decided[1]
            err = handle.exception(0)
            if err is not None:
                self._on_error(err)
                return
            if outcome is None:         # no continuation ran: decide here
                job = handle.context
                tailed, job.tailed = job.tailed, None
                outcome = self._decide(handle.result(0).logits, job.timings,
                                       job.past_len + job.token_count, chain=None,
                                       tailed=tailed)
            self._deliver(outcome)
        except Exception as e:          # a bug must not leave the consumer waiting
            self._finish(FinishReason.ERROR, self._bug(e))

    def _bug(self, e: Exception) -> CalfsmError:
        """An unexpected exception in a step of this stream, logged; what the stream ends
        with (a CalfsmError as it is, anything else as Internal)."""
        log.exception("stream step of sequence %s failed", self.sequence.seq_id)
        return e if isinstance(e, CalfsmError) else Internal(
            f"unexpected {type(e).__name__} in a stream step: {e}",
            seq_id=self.sequence.seq_id, stage="stream")

    def _decide(self, logits: np.ndarray, timings: Any, position: int, *,
                chain: JobHandle | None, tailed: Any = None) -> _Outcome:
        """A step's logits are in: sample, record the token (not yet woken), and decide
        how the stream goes on: ``(reason, error, next)`` with ``next`` the decode still
        to run the ordinary way (its request and the step prepared for it). ``chain``:
        the step's handle when this runs as its continuation; a prepared next decode is
        then booked after it and ``next`` is a :class:`~calfsm.engine.job.Successor` for the
        core to run."""
        if self._cancelled:
            return FinishReason.CANCELLED, None, None
        flow = self._flow
        want, flow.replay_check = flow.replay_check, None
        try:
            token, scored = self._draw(logits, want, tailed)
        except CalfsmError as e:
            return FinishReason.ERROR, e, None
        if want is not None and token != want:
            return FinishReason.ERROR, Internal(
                f"the replay after a reset gave token {token}, not {want}",
                seq_id=self.sequence.seq_id, stage="resume"), None
        if want is None and self._sampler.ends(token, len(self._tokens)):
            return FinishReason.STOP, None, None
        # ``position``: where ``token`` goes. The token is the stream's from here (a next
        # step that fails at once ends the stream with it), but the consumer is woken
        # only after the next step went to the submitter (but for the first: _record)
        now = self._clock.now()     # one read: the token's time and the deadline's
        recorded = want is not None or self._record(token, timings, position, now, scored)
        if not recorded:
            return FinishReason.CANCELLED, None, None
        if recorded == "stop":              # a stop sequence is complete: not delivered
            return FinishReason.STOP, None, None
        if len(self._tokens) >= self.params.max_tokens or position >= self._max_seq:
            return FinishReason.LENGTH, None, None
        if self._cancelled:
            return FinishReason.CANCELLED, None, None
        if now >= self._deadline:
            return FinishReason.DEADLINE, DeadlineExceeded(
                "stream deadline passed", seq_id=self.sequence.seq_id, stage="stream"), None
        staged = flow.take(position)
        if chain is not None and staged is not None:
            # the core runs it with its token, right after this continuation returns
            if self.sequence.follow(staged, after=chain):
                then = _off_path(self, self._track(staged, staged.context.request))
                return None, None, Successor(staged, token, then)
            staged = None
        request = Request.decode(self.sequence.seq_id, token, position,
                                 target=flow.staged_row(staged),
                                 deadline_s=None if self._deadline == _NO_DEADLINE
                                 else self._left(),
                                 priority=self.priority, request_id=self.request_id)
        # nothing prepared (or it is gone): the ordinary way, once the step has resolved
        return None, None, (request, staged)

    def _draw(self, logits: np.ndarray, want: int | None, tailed: Any
              ) -> tuple[int, tuple[float, tuple[tuple[int, float], ...]] | None]:
        """The step's token and, when asked for, its logprobs (``(logprob, top)``).

        A replay after a resume (``want``) draws nothing: the seeded sequence of draws
        goes on as if no fault had happened; greedy checks the replay instead. The
        native tail's choice (calfsm/engine/tail.py) when it made one; else a plain
        sample (the hot path), or one with logits processors or logprobs: the
        processors see the prompt and the tokens before this one (a replay checks the
        last delivered token, so it is not theirs); logprobs only for a new token, not
        a replay's (its event was delivered already)."""
        sampler = self._sampler
        replay = want is not None
        if want is not None and not self.params.greedy:
            return want, None
        if tailed is not None and (chosen := sampler.tail_token(tailed)) is not None:
            return chosen, None
        if sampler.plain:
            return sampler.sample(logits), None
        tokens: Seq[int] = ()
        if sampler.uses_tokens:
            tokens = TokenHistory(self.prompt, self._tokens,
                                  len(self.prompt) + len(self._tokens) - replay)
        if replay or self.params.logprobs is None:
            return sampler.sample(logits, tokens), None
        token, logprob, top = sampler.sample_logprobs(logits, tokens)
        return token, (logprob, top)

    def _deliver(self, outcome: _Outcome) -> None:
        """Run what :meth:`_decide` left (the next step the ordinary way), then wake the
        consumer, then end the stream if it ends here."""
        reason, error, pending = outcome
        if pending is not None:
            self._submit(*pending)
        with self._lock:
            self._wake_locked()
        if reason is not None:
            self._finish(reason, error)

    def _record(self, token: int, timings: Any, position: int, now: float,
                scored: tuple[float, tuple[tuple[int, float], ...]] | None = None
                ) -> bool | str:
        """Make ``token`` the stream's (not yet woken), with its logprobs if ``scored``;
        False if a cancel or the end of the stream came first: then nothing is
        delivered. With stop sequences or stop strings, the tokens that may begin one
        are held back; ``"stop"`` when one is complete (what it holds is dropped, what
        was held before it delivered). ``now``: the clock, the token's time."""
        with self._lock:
            if self._cancelled or self._ending:
                return False
            tokens = self._tokens
            if self._plain:
                tokens.append(token)
                self._times.append(now)
                self._events.append(TokenEvent(token, position, len(tokens) - 1, timings,
                                               None, *(scored or (None, ()))))
                self._delivered += 1
                kept: bool | str = True
            else:
                kept = self._record_held_locked(token, timings, position, now, scored)
            if not self._woke and self._events:
                # the first token wakes its consumer at once, before the next step goes
                # to the submitter: the time to the first token is what a client waits
                # on; every later token waits for that (the device first)
                self._wake_locked()
            return kept

    def _record_held_locked(self, token: int, timings: Any, position: int, now: float,
                            scored: tuple[float, tuple[tuple[int, float], ...]] | None
                            ) -> bool | str:
        """:meth:`_record` with text or stop sequences: decode the token's text, then
        deliver what can no longer begin a stop sequence or a stop string."""
        text = None if self._text is None else self._text.push(token)
        tokens = self._tokens
        tokens.append(token)
        self._times.append(now)
        held = self._held
        held.append(TokenEvent(token, position, len(tokens) - 1, timings, text,
                               *(scored or (None, ()))))
        params = self.params
        free = len(tokens) - params.min_tokens      # the tokens a stop may cover
        if free <= 0:                   # the first min_tokens tokens: no stop, none held
            self._release_locked(len(held), None)
            return True
        whole, part, stopped = len(held), None, False
        if params.holds_back:
            matched = params.stop_match(tokens)
            matched = matched if matched <= free else 0
            whole = max(0, len(held) - (matched or min(params.stop_prefix(tokens), free)))
            stopped = bool(matched)
        stops = None if self._text is None else self._text.stops
        if stops is not None:
            w, p, s = stops.split([e.text for e in held])
            if s and (not stopped or w < whole):    # the stop that begins first wins
                whole, part, stopped = w, p, True
            elif not stopped:
                whole = min(whole, w)
        self._release_locked(whole, part)
        if stopped:
            self._held = []
            if self._text is not None:  # what its decoder holds is the stop's: never given
                self._text.drop()
            return "stop"
        return True

    def _release_locked(self, whole: int, part: int | None) -> None:
        """Deliver the first ``whole`` held events, and the next one with only the first
        ``part`` characters of its text when ``part`` is not None; the rest stay held."""
        held = self._held
        out = held[:whole]
        if part is not None:
            cut = held[whole]
            out.append(attrs.evolve(cut, text=cut.text[:part]))
        self._events.extend(out)
        self._delivered += len(out)
        if self._text is not None:
            self._text.delivered.extend(e.text for e in out)
        self._held = held[len(out):]

    def _release_end_locked(self, reason: FinishReason, error: CalfsmError | None
                            ) -> tuple[FinishReason, CalfsmError | None]:
        """The stream ends (not cancelled): what was held is delivered after all (no stop
        came), then what the decoder still holds, unless a stop string completes in it
        (then the stream ends ``stop`` instead of ``length``). The reason and error the
        stream ends with."""
        held, text = self._held, self._text
        tail = ""
        if text is not None:
            try:
                tail = text.flush()
            except CalfsmError as e:
                if reason is not FinishReason.ERROR:
                    reason, error = FinishReason.ERROR, e
            if text.stops is not None and tail and len(self._tokens) > self.params.min_tokens:
                whole, part, stopped = text.stops.split([*(e.text for e in held), tail])
                if stopped:
                    self._release_locked(whole, part if whole < len(held) else None)
                    if whole == len(held) and part is not None:
                        text.delivered.append(tail[:part])
                    return (FinishReason.STOP if reason is FinishReason.LENGTH
                            else reason), error
        self._release_locked(len(held), None)
        if tail:
            text.delivered.append(tail)
        return reason, error

    def _on_error(self, err: CalfsmError) -> None:
        if isinstance(err, Cancelled) or self._cancelled:
            self._finish(FinishReason.CANCELLED, err if isinstance(err, Cancelled) else None)
        elif isinstance(err, DeadlineExceeded) and self._clock.now() >= self._deadline:
            self._finish(FinishReason.DEADLINE, err)
        elif self._flow.resumable(self._lost(), err):
            self._flow.lose()
            self._wait_for_ready()
        else:
            if self._lost():
                # a device reset, or this row's own failure: the sequence alone is lost
                err = Unavailable(f"the KV of sequence {self.sequence.seq_id} was lost "
                                  f"({err.message})",
                                  seq_id=self.sequence.seq_id, stage="stream",
                                  retry_after_s=self.sequence.front.lifecycle.retry_after_s)
            self._finish(FinishReason.ERROR, err)

    def _lost(self) -> bool:
        """The step failed because the sequence's KV is gone: a structured fact of the
        sequence (Lost, booked from the KV coordinator before this callback runs), never
        read from an error's text."""
        return self.sequence.state == SequenceState.LOST

    # ---- resume --------------------------------------------------------------------
    def _wait_for_ready(self) -> None:
        """Replay once the executor is Ready again (a lifecycle listener; the replay
        itself is deferred to the executor's admission step, outside every lock)."""
        ex = self.sequence.front
        life = ex.lifecycle
        with self._lock:
            if not self._listening:
                self._listening = True
                life.on_change(self._lifecycle_changed)
        self._lifecycle_changed()           # it may be Ready, Failed or closing already

    def _lifecycle_changed(self) -> None:
        ex = self.sequence.front
        life = ex.lifecycle
        if not self._listening:
            return
        if life.ready or life.closing or life.state == "Failed" or self._cancelled:
            with self._lock:
                if not self._listening:
                    return
                self._listening = False
            life.remove_listener(self._lifecycle_changed)
            if self._cancelled:
                self._finish(FinishReason.CANCELLED)
            elif life.ready:
                self.sequence.defer(self._replay)
            else:
                self._finish(FinishReason.ERROR, Unavailable(
                    f"device {life.state} while the stream waited to resume",
                    seq_id=self.sequence.seq_id, stage="resume"))

    def _replay(self) -> None:
        if self._cancelled:
            self._finish(FinishReason.CANCELLED)
            return
        if not self.sequence.front.lifecycle.ready:
            self._wait_for_ready()          # it left Ready again: this costs no resume
            return
        seq = self.sequence
        if not seq.idle():
            # the step this one followed is still on its way back (this one failed
            # first): its KV is not the sequence's to reset before it has ended
            seq.when_idle(lambda: seq.defer(self._replay))
            return
        if self._start:
            self._finish(FinishReason.ERROR, Unavailable(
                "cannot resume a stream that started after earlier KV of its sequence: "
                "reset() the sequence and send the whole prompt again",
                seq_id=seq.seq_id, stage="resume", retry_after_s=0.0))
            return
        try:
            seq.reset()
        except CalfsmError as e:
            self._finish(FinishReason.ERROR, e)
            return
        if not self._flow.begin_replay(self._tokens):
            return                  # ended meanwhile (a shutdown's abort): nothing to do
        history = list(self.prompt) + self._tokens[:-1]
        seq.front.observers.stream_resumed(self)
        _limited.warning("resume", "stream on sequence %s resumes after a reset: "
                         "replaying %s tokens", seq.seq_id, len(history),
                         extra={"seq_id": seq.seq_id, "stage": "resume",
                                "request_id": self.request_id})
        self._submit(Request.prefill(seq.seq_id, history, target=self._flow.row(),
                                     deadline_s=self._left(), priority=self.priority,
                                     request_id=self.request_id))

    # ---- ending --------------------------------------------------------------------
    def _finish(self, reason: FinishReason, error: CalfsmError | None = None) -> None:
        with self._lock:
            if self._ending:
                return
            self._ending = True
            self._flow.stopping = True
            if error is not None:
                # raised in this stream's own steps, its traceback would hold them (and
                # the stream) alive in a cycle with the result
                drop_tracebacks(error)
                error.with_context(request_id=self.request_id)
            if reason is not FinishReason.CANCELLED and (self._held or self._text is not None):
                # no stop came: what was held back is output after all (a cancel
                # delivers nothing more)
                reason, error = self._release_end_locked(reason, error)
            self._held = []
            delivered = self._delivered
            times = self._times[:delivered]
            ttft = times[0] - self.arrival if times else None
            itl = tuple(map(operator.sub, times[1:], times[:-1]))    # no call per token
            result = GenerationResult(
                tuple(self._tokens[:delivered]), reason,
                Usage(len(self.prompt), delivered, self.cached), ttft, itl, error,
                self._flow.resumes, None if self._text is None else "".join(self._text.delivered))
        ex = self.sequence.front
        ex.live_streams.remove(self)
        ex.live_requests.discard(self.request_id, self)
        # observers first (holding no lock), so a consumer that has the result finds
        # the stream counted
        ex.observers.stream_ended(self, result)
        # what the stream held is handed back before its consumer is woken, so a
        # consumer that has the result and waits for the executor to be idle sees the
        # prepared step discarded and the one-shot sequence's release pending
        self._flow.end()
        if self._listening:
            self._listening = False
            self.sequence.front.lifecycle.remove_listener(self._lifecycle_changed)
        if self._keeper is not None:
            # kept warm (or released) before the consumer wakes: a caller that has this
            # result and sends the next turn finds it (unless the last step is still on
            # the device: then the moment it ends). Its KV holds the prompt and the drawn
            # tokens (every step carried the stream's own), unless it began later than
            # the sequence's start: earlier KV is not the stream's to name
            history = (*self.prompt, *self._tokens)
            self.sequence.when_idle(
                self.sequence.close_when_done if self._start else
                lambda: self._keeper.keep(self.sequence, history))
        elif self._close_sequence:
            # the id is back before the consumer wakes: a caller that has this result
            # may open the next stream at once (unless the last step is still on the
            # device: then the moment it ends)
            self.sequence.close_when_done()
        with self._lock:
            self._result = result
            self._wake_locked()

    def _wake_locked(self) -> None:
        self._woke = True
        self._lock.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_settle, fut)

    def __repr__(self) -> str:
        state = self._result.finish_reason.value if self._result else "running"
        return f"<Stream seq={self.sequence.seq_id} {len(self._tokens)} tokens {state}>"


def _off_path(stream: Stream, worth: bool) -> Callable[[], None] | None:
    """What ``stream`` does off the token path while its step in flight runs: prepare
    the step after it (``worth``: another may follow), and the constraint's mask for
    its token; None: nothing."""
    if worth:
        return stream._stage_next
    return (lambda: _prepare_mask(stream)) if stream._sampler.constrained else None


def _prepare_mask(stream: Stream) -> None:
    """The constraint's mask for the token of ``stream``'s step in flight, made while
    the device runs it (the history read in place: only its length is taken now)."""
    if not stream._ending:
        stream._sampler.prepare(TokenHistory(stream.prompt, stream._tokens))


class StreamText:
    """A stream's text, on an executor with a tokenizer: its incremental decoder (None
    once the stream ended, or a stop ended it: what the decoder still holds is then the
    stop's), its stop strings (None without), and the texts delivered so far."""

    __slots__ = ("decoder", "delivered", "seq_id", "stops")

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], seq_id: int) -> None:
        self.decoder: IncrementalDecoder | None = incremental_decoder(tokenizer)
        self.stops = StopStrings(stop) if stop else None
        self.delivered: list[str] = []
        self.seq_id = seq_id

    def push(self, token: int) -> str:
        """The text ``token`` completes; a decoder's own failure (not a CalfsmError) is
        Internal (category programming): the stream ends ``error``."""
        try:
            return self.decoder.push(token)
        except CalfsmError:
            raise
        except Exception as e:
            raise self._bug(f"on token {token}", e) from e

    def flush(self) -> str:
        """What the decoder still holds (once: the decoder is dropped)."""
        decoder, self.decoder = self.decoder, None
        if decoder is None:
            return ""
        try:
            return decoder.flush()
        except CalfsmError:
            raise
        except Exception as e:
            raise self._bug("on flush", e) from None

    def drop(self) -> None:
        """A stop ended the stream: what the decoder holds is never given."""
        self.decoder = None

    def _bug(self, where: str, e: Exception) -> Internal:
        return Internal(f"the tokenizer's decoder raised {type(e).__name__} {where}: {e}",
                        category=ErrorCategory.PROGRAMMING, stage="tokenizer",
                        seq_id=self.seq_id)


def _check_options(deadline_s: Any, max_resumes: Any, cached: Any, most_cached: int,
                   seq_id: int) -> None:
    """A stream's options, each refused with an InvalidArgument naming it."""
    if deadline_s is not None and not (isinstance(deadline_s, int | float)
                                       and deadline_s > 0):
        raise InvalidArgument(f"deadline_s must be > 0, got {deadline_s!r}",
                              stage="request")
    if isinstance(max_resumes, bool) or not isinstance(max_resumes, int) \
            or max_resumes < 0:
        raise InvalidArgument(f"max_resumes must be an integer >= 0, got "
                              f"{max_resumes!r}", stage="request")
    if isinstance(cached, bool) or not isinstance(cached, int) \
            or not 0 <= cached <= most_cached:
        raise InvalidArgument(f"cached must be an integer in 0..{most_cached} (at least "
                              f"one prompt token is prefilled), got {cached!r}",
                              stage="request", seq_id=seq_id)


def _arrival(arrival: Any, now: float, seq_id: int) -> float:
    """A request's arrival time (None: ``now``, the stream's creation); refused unless a
    finite time no later than ``now`` on the executor's clock."""
    if arrival is None:
        return now
    if isinstance(arrival, bool) or not isinstance(arrival, int | float) \
            or not math.isfinite(arrival) or arrival > now:
        raise InvalidArgument(f"arrival must be a time of the executor's clock no later "
                              f"than now ({now}), got {arrival!r}", stage="request",
                              seq_id=seq_id)
    return float(arrival)


def judge_stream(prompt: Seq[int] | str, params: SamplingParams | None, tokenizer: Any,
                 priority: Any, model: Any, *, position: int = 0,
                 seq_id: int | None = None) -> tuple[Request, SamplingParams]:
    """A stream's arguments judged before anything is taken for it
    (:mod:`calfsm.generate.arguments`): the prompt (text through ``tokenizer``) as the prefill
    request that types it and the priority, its length and ids against the limits of
    ``model`` (the configured model) at ``position``, and ``max_tokens`` against the room
    left; ``params`` None becomes the default clipped to that room. Raises
    InvalidArgument."""
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidArgument("params must be SamplingParams", stage="request")
    checked = _checked_prompt(seq_id, prompt, params, tokenizer, priority)
    n, limits = len(checked.tokens), ContextLimits.of(model)
    try:
        room = check_prompt(checked.tokens, limits, position=position)
        if params is None:
            params = default_params(room)
        else:
            check_max_tokens(params.max_tokens, n, limits, position=position,
                             field="SamplingParams.max_tokens")
        if params.constraint is not None:     # compiled now (cached): a 400 up front
            compile_constraint(params.constraint, tokenizer,
                               model.submodel(TaskKind.DECODE).vocab)
    except InvalidArgument as e:
        raise e.with_context(seq_id=seq_id) from None
    return checked, params


def _checked_prompt(seq_id: int | None, prompt: Seq[int] | str,
                    params: SamplingParams | None, tokenizer: Any,
                    priority: Any) -> Request:
    """A stream's prompt as the prefill request that types it and checks the priority
    (text needs the executor's tokenizer, and so do stop strings); its length and ids
    are :func:`judge_stream`'s to judge."""
    if params is not None and params.stop and tokenizer is None:
        raise InvalidArgument("SamplingParams.stop: stop strings are matched on the "
                              "stream's text, which needs the executor's tokenizer "
                              "(DeviceExecutor(..., tokenizer=...))", stage="request",
                              seq_id=seq_id)
    if isinstance(prompt, str):
        prompt = encode_prompt(tokenizer, prompt)
    return Request.prefill(0 if seq_id is None else seq_id, prompt, priority=priority)


def max_new_tokens(params: SamplingParams, max_seq: int, position: int,
                   prompt_tokens: int) -> int:
    """Tokens a stream can give at most: ``max_tokens``, bounded by the context left
    after ``position`` and the prompt (at least one: the prefill's)."""
    return max(1, min(params.max_tokens, max_seq - position - prompt_tokens + 1))


#: what a step's end decided: (finish reason or None, its error, the next decode still to
#: run: the ordinary way, (request, the step prepared for it), or by the core, a
#: Successor (only from a continuation), or None)
_Outcome = tuple[FinishReason | None, CalfsmError | None,
                 tuple[Request, JobHandle | None] | Successor | None]
#: the stream goes on, its next step already running: nothing left to do but wake
_GOES_ON: _Outcome = (None, None, None)


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
