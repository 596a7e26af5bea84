"""``LlamaContext``: ``llama_decode`` over a calfsm executor, logits where llama.cpp keeps
them.

Theory of operation
-------------------
A context owns ``n_seq_max`` sequence ids of the executor (``open_sequence``; released
on :meth:`LlamaContext.close`), a float32 output buffer of ``n_outputs_max`` rows of the
vocabulary (the caller's own array, or one allocated once here) and its
:class:`~calfsm.llama.memory.LlamaMemory`.

:meth:`LlamaContext.decode_sync` checks the whole batch first
(:func:`~calfsm.llama.batch.plan_batch`, then the executor's
:func:`~calfsm.request.check_request` for every job), so a bad batch runs nothing. Then
each ubatch is one executor job; the k-th ubatches of every sequence in the batch (a
batch calbin may take several) are queued together, one round, so their decodes share
device steps where the executor batches; a job whose last token is flagged writes that
token's logits straight into its row of the output buffer (the request's ``target``:
no vocabulary-sized temporary); the other jobs write into one scratch row owned by the
context. ``get_logits_ith(i)`` is a view of the row of batch token ``i``.

:meth:`LlamaContext.decode` is ``llama_decode``: the same, with the error turned into
llama.cpp's return code by :data:`~calfsm.llama.codes.RETURN_CODES`. As llama.cpp
documents, after 1 (no KV slot) and -1 (invalid input) the sequence holds what it held
before the call — ubatches already committed are truncated away — and after 2 (aborted)
and a fatal code what was processed stays (``memory.seq_pos_max`` says how much; after
a device failure nothing: start again at position 0). Outputs of a failed call are
gone after 1 and -1, kept for the ubatches that finished otherwise.

Every failure is logged once with its context (job, sequence, generation, raw CalRT code,
stage): a job's failure is logged by the executor when it resolves the job (a cancel
excepted), so this module logs only what it raises itself, what ``enqueue`` refused
synchronously, and aborts.

Abort: ``set_abort_callback(fn)`` is asked before every ubatch (llama.cpp asks it during
the graph; a calfsm job cannot be stopped half way); :meth:`LlamaContext.abort`, from
another thread, cancels the job in flight (before submit nothing runs; after submit the
job runs and its result is dropped).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np

from calfsm.engine.epoch import WARMUP_SEQ
from calfsm.engine.job import InferenceResult, JobHandle
from calfsm.errors import CalfsmError, Cancelled, InvalidArgument, Unavailable
from calfsm.generate.arguments import check_n
from calfsm.llama import codes
from calfsm.llama.batch import BatchPlan, LlamaBatch, SeqPart, Ubatch, plan_batch
from calfsm.llama.memory import LlamaMemory
from calfsm.manifest import TaskKind
from calfsm.request import Request, check_request
from calfsm.runtime.stepper import StepScheduler

if TYPE_CHECKING:
    from calfsm.executor import DeviceExecutor
    from calfsm.generate.sequence import Sequence

__all__ = ["DecodeResult", "LlamaContext", "decode", "decode_sync"]

log = logging.getLogger("calfsm.llama")

_STAGE = "llama_decode"


@attrs.frozen
class DecodeResult:
    """A decoded batch: its (first) sequence (llama id), where that started, the batch
    indexes that have logits (row ``k`` of the output buffer is ``outputs[k]``), each
    job's result in the order they ran — its ``logits`` a view of its row (of the scratch
    row for a job without an output), valid until the next decode — and every sequence
    the batch held, in order of first appearance."""

    seq_id: int
    pos0: int
    n_tokens: int
    outputs: tuple[int, ...]
    jobs: tuple[InferenceResult, ...] = attrs.field(repr=False)
    seq_ids: tuple[int, ...] = ()


@attrs.frozen
class _Job:
    """One ubatch's job: its part of the batch, the request, its output row (or None)."""

    part: SeqPart
    ub: Ubatch
    request: Request
    row: int | None


class LlamaContext:
    """llama.cpp's ``llama_context`` over a :class:`~calfsm.executor.DeviceExecutor`.

    ``n_seq_max`` sequences (llama ids ``0 .. n_seq_max-1``); ``n_outputs_max`` rows of
    logits per batch, in ``logits`` when given (a writeable C-contiguous float32 array of
    shape ``(n_outputs_max, n_vocab)``); ``n_ubatch`` caps the tokens of one job (default:
    what the prefill graph takes); ``deadline_s`` bounds each job (default: the
    executor's). Use as a context manager.
    """

    def __init__(self, executor: DeviceExecutor, *, n_seq_max: int = 1,
                 n_outputs_max: int = 1, logits: np.ndarray | None = None,
                 n_ubatch: int | None = None, deadline_s: float | None = None) -> None:
        for name, v in (("n_seq_max", n_seq_max), ("n_outputs_max", n_outputs_max)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"{name} must be an integer >= 1, got {v!r}",
                                      stage="llama_context")
        epoch = executor.epoch
        if epoch is None:
            raise Unavailable("the executor has no configured model", stage="llama_context")
        # more sequences than the executor opens at once could never all be opened
        check_n(n_seq_max, executor.max_sequences, field="n_seq_max")
        self.executor = executor
        self.n_vocab = epoch.contract(TaskKind.DECODE).vocab
        self.n_ctx = epoch.contract(TaskKind.DECODE).max_seq
        #: a batch may hold several sequences: the decode graph has a batch dimension,
        #: and the executor puts their decodes into one device job where it batches
        self.multi_sequence = epoch.contract(TaskKind.DECODE).batched
        self._max_tokens = {k: c.max_tokens for k, c in epoch.model.submodels.items()}
        limit = self._max_tokens.get(TaskKind.PREFILL_IDS, 1)
        if n_ubatch is not None and (isinstance(n_ubatch, bool) or not isinstance(
                n_ubatch, int) or not 1 <= n_ubatch <= limit):
            raise InvalidArgument(f"n_ubatch must be in 1..{limit} (the prefill graph's "
                                  f"tokens), got {n_ubatch!r}", stage="llama_context")
        self.n_ubatch = n_ubatch or limit
        self.deadline_s = deadline_s
        self._logits = _output_buffer(logits, n_outputs_max, self.n_vocab)
        self._scratch = np.empty(self.n_vocab, np.float32)   # logits nobody asked for
        self._rows: dict[int, int] = {}                      # batch index -> row
        self._n_outputs = 0
        self._lock = threading.RLock()
        self._abort_cb: Callable[[], bool] | None = None
        self._abort_lock = threading.Lock()
        self._current: list[JobHandle] = []         # the jobs of the round in flight
        self._abort_requested = False
        self._decoding = False
        self._sequences: list[Sequence] = []
        try:
            for _ in range(n_seq_max):
                self._sequences.append(executor.open_sequence())
        except BaseException:
            self.close()
            raise
        self.memory = LlamaMemory(executor, tuple(s.seq_id for s in self._sequences),
                                  self._lock)

    @property
    def n_seq_max(self) -> int:
        return len(self._sequences)

    @property
    def n_outputs_max(self) -> int:
        return self._logits.shape[0]

    # ---- decoding -------------------------------------------------------------------
    def decode(self, batch: LlamaBatch) -> int:
        """``llama_decode``: 0, or the return code of the failure (see
        :data:`~calfsm.llama.codes.RETURN_CODES`)."""
        try:
            self.decode_sync(batch)
        except CalfsmError as err:
            return codes.return_code(err)
        return codes.SUCCESS

    def decode_sync(self, batch: LlamaBatch) -> DecodeResult:
        """Decode ``batch``; its :class:`DecodeResult`, or raise the
        :class:`~calfsm.errors.CalfsmError` (spec 6.1's ``decode_sync``)."""
        with self._lock:
            self._rows, self._n_outputs = {}, 0
            ctx = {"generation": self.executor.generation}
            try:
                plan = plan_batch(batch, seq_ids=self.memory.seq_ids,
                                  n_ubatch=self._ubatch_limit(batch),
                                  n_outputs_max=self.n_outputs_max,
                                  next_pos=self.memory.n_held, context=ctx,
                                  multi=self.multi_sequence)
                rounds = self._requests(plan)
            except CalfsmError as err:
                raise self._logged(err) from None
            with self._abort_lock:
                self._decoding, self._abort_requested = True, False
            try:
                return self._run(plan, rounds)
            finally:
                with self._abort_lock:
                    self._decoding = False

    def _ubatch_limit(self, batch: LlamaBatch) -> int:
        if isinstance(batch, LlamaBatch) and batch.embd is not None and len(batch.embd):
            return self._max_tokens.get(TaskKind.PREFILL_EMBEDS, 1)
        return self.n_ubatch

    def _requests(self, plan: BatchPlan) -> list[list[_Job]]:
        """One request per ubatch, in rounds (:meth:`BatchPlan.rounds`), each checked
        against its graph before any runs."""
        epoch = self.executor.epoch
        if epoch is None:
            raise Unavailable("the executor has no configured model", stage=_STAGE)
        kw = {} if self.deadline_s is None else {"deadline_s": self.deadline_s}
        rank = {b: r for r, b in enumerate(plan.outputs)}   # batch index -> output row
        out = []
        for rnd in plan.rounds():
            jobs = []
            for part, ub in rnd:
                dev = self.memory.device_seq(part.seq)
                b = part.batch_index(ub)
                target = self._logits[rank[b]] if ub.output else self._scratch
                past = part.pos0 + ub.start
                index = list(part.index[ub.start:ub.stop])
                if plan.embd is not None:
                    if TaskKind.PREFILL_EMBEDS not in self._max_tokens:
                        raise InvalidArgument("the model has no prefill_embeds graph",
                                              stage="llama_batch", seq_id=dev)
                    req = Request.prefill_embeds(dev, plan.embd[index], past_len=past,
                                                 target=target, **kw)
                elif len(index) == 1:
                    req = Request.decode(dev, plan.tokens.item(index[0]), past,
                                         target=target, **kw)
                else:
                    req = Request.prefill(dev, plan.tokens[index], past_len=past,
                                          target=target, **kw)
                check_request(req, epoch.contract(req.kind), seq_limit=WARMUP_SEQ,
                              context={"seq_id": dev, "generation": epoch.generation,
                                       "stage": "llama_batch"})
                jobs.append(_Job(part, ub, req, rank.get(b) if ub.output else None))
            out.append(jobs)
        return out

    def _run(self, plan: BatchPlan, rounds: list[list[_Job]]) -> DecodeResult:
        results: list[InferenceResult] = []
        rows: dict[int, int] = {}               # batch index -> output row, finished
        ran: set[int] = set()                   # parts with a finished ubatch
        try:
            for part in plan.parts:
                if part.pos0 == 0 and self.memory.is_lost(part.seq):
                    try:                         # start again: clear it first
                        self.memory.seq_rm(part.seq, -1, -1)
                    except CalfsmError as err:
                        raise self._logged(err) from None
            for jobs in rounds:
                done, err = self._round(jobs)
                for job, result in done:
                    results.append(result)
                    ran.add(job.part.seq)
                    if job.row is not None:
                        rows[job.part.batch_index(job.ub)] = job.row
                if err is not None:
                    raise err
        except CalfsmError as err:
            code = codes.return_code(err)
            if code in (codes.NO_KV_SLOT, codes.INVALID_INPUT):
                rows = {}
                self._restore([p for p in plan.parts if p.seq in ran], err)
            self._set_outputs(rows)
            raise
        self._set_outputs(rows)
        return DecodeResult(plan.seq, plan.pos0, plan.n_tokens, plan.outputs,
                            tuple(results), tuple(p.seq for p in plan.parts))

    def _set_outputs(self, rows: dict[int, int]) -> None:
        """The rows a finished (or partly finished) decode answers for; ``get_logits``
        covers the leading rows that all finished."""
        have = set(rows.values())
        n = 0
        while n in have:
            n += 1
        self._rows, self._n_outputs = rows, n

    def _restore(self, parts: list[SeqPart], err: CalfsmError) -> None:
        """Truncate the ubatches this call committed (llama.cpp: after 1 or -1 the memory
        is as before the call). A failed truncation is raised instead."""
        try:
            for part in parts:
                self.memory.truncate(part.seq, part.pos0)
        except CalfsmError as e:
            raise self._logged(e) from err

    def _round(self, jobs: list[_Job]
               ) -> tuple[list[tuple[_Job, InferenceResult]], CalfsmError | None]:
        """Run one round's jobs together (their decodes may share device steps) to their
        ends, in either executor mode: the finished ones, and the first error in round
        order (every job enqueued is waited for, whatever failed)."""
        by = ("abort()" if self._abort_requested else
              "the abort callback" if self._abort_cb is not None and self._abort_cb()
              else None)
        if by is not None:
            return [], self._logged(Cancelled(
                f"aborted by {by} before the next ubatch", stage=_STAGE,
                seq_id=jobs[0].request.seq_id, generation=self.executor.generation))
        handles: list[JobHandle] = []
        refused: CalfsmError | None = None
        for job in jobs:
            try:
                handle = self.executor.enqueue_nowait(job.request)
            except CalfsmError as err:      # refused before a job existed: ours to log
                refused = self._logged(err.with_context(seq_id=job.request.seq_id))
                break
            handles.append(handle)
            with self._abort_lock:
                self._current.append(handle)
                if self._abort_requested:
                    handle.cancel()
        try:
            if not self.executor.config.threaded:
                StepScheduler.for_steps(self.executor.steps).run_until(
                    lambda: all(h.done() for h in handles))
            done, first = [], None
            for job, handle in zip(jobs, handles, strict=False):
                try:
                    done.append((job, handle.result()))
                except Cancelled as err:    # the executor does not log a cancel
                    first = first or self._logged(err)
                except CalfsmError as err:
                    first = first or err
            return done, first or refused
        finally:
            with self._abort_lock:
                self._current = []

    def _logged(self, err: CalfsmError) -> CalfsmError:
        code = codes.return_code(err)
        log.warning("llama decode fails with %d: %s", code, err,
                    extra={**err.context(), "llama_code": code})
        return err

    # ---- aborting -------------------------------------------------------------------
    def set_abort_callback(self, fn: Callable[[], bool] | None) -> None:
        """``llama_set_abort_callback``: ``fn()`` is asked before every ubatch; True
        aborts the decode (return code 2)."""
        self._abort_cb = fn

    def abort(self) -> bool:
        """Abort the decode in progress (any thread): the job in flight is cancelled and
        no further ubatch runs. False (and nothing happens) if no decode is running."""
        with self._abort_lock:
            if not self._decoding:
                return False
            self._abort_requested = True
            handles = list(self._current)
        for handle in handles:
            handle.cancel()
        return True

    # ---- logits ---------------------------------------------------------------------
    def get_logits(self) -> np.ndarray:
        """``llama_get_logits``: the rows of the last decode, one per flagged token in
        batch order (a view, valid until the next decode)."""
        return self._logits[:self._n_outputs]

    def get_logits_ith(self, i: int) -> np.ndarray:
        """``llama_get_logits_ith``: the logits of batch token ``i`` of the last decode
        (negative: counted from the last output). InvalidArgument if it has none."""
        if isinstance(i, bool) or not isinstance(i, int | np.integer):
            raise InvalidArgument(f"i must be an integer, got {i!r}", stage="llama_logits")
        i = int(i)
        if i < 0:
            row = self._n_outputs + i
            if row < 0:
                raise InvalidArgument(f"no output {i}: the last decode has "
                                      f"{self._n_outputs} outputs", stage="llama_logits")
        else:
            row = self._rows.get(i, -1)
            if row < 0:
                raise InvalidArgument(f"batch token {i} has no logits: its logits flag was "
                                      "not set, or the last decode did not reach it",
                                      stage="llama_logits")
        return self._logits[row]

    # ---- closing --------------------------------------------------------------------
    def close(self) -> None:
        """Release the sequences (their KV) back to the executor. Idempotent."""
        while self._sequences:
            self._sequences.pop().close()

    def __enter__(self) -> LlamaContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<LlamaContext seqs={self.n_seq_max} vocab={self.n_vocab} "
                f"outputs={self.n_outputs_max}>")


def _output_buffer(logits: np.ndarray | None, rows: int, vocab: int) -> np.ndarray:
    if logits is None:
        return np.zeros((rows, vocab), np.float32)
    if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 \
            or logits.shape != (rows, vocab) or not logits.flags.c_contiguous \
            or not logits.flags.writeable:
        what = (f"{logits.dtype} {logits.shape}" if isinstance(logits, np.ndarray)
                else type(logits).__name__)
        raise InvalidArgument(f"logits must be a writeable C-contiguous float32 array of "
                              f"shape ({rows}, {vocab}), got {what}", stage="llama_context")
    return logits


def decode(ctx: LlamaContext, batch: LlamaBatch) -> int:
    """``llama_decode(ctx, batch)``."""
    return ctx.decode(batch)


def decode_sync(ctx: LlamaContext, batch: LlamaBatch) -> DecodeResult:
    """``decode_sync(batch)`` of spec 6.1: the result, or the error raised."""
    return ctx.decode_sync(batch)
