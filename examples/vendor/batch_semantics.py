"""Vendor runner: do the rows of a batch job keep apart, can rows of different lengths
and positions share one job, and does a failed batch job (or row) leave every row's KV
untouched or fully written? (spec section 14; docs/driver-protocol.md, Batches)

It needs a batch calbin: a manifest whose decode graph has ``max_batch`` B > 1 (the
default ``qwen3-b8``, or ``tiny-b8``). On a batch-1 manifest it stops with a usage error
(exit status 2) and writes nothing, so a run on the wrong manifest cannot replace the
evidence about this device's batch graphs. With raw protocol calls only it observes:

1. the real maximum rows: ``set_batch_rows`` with 0 .. B+1 (0 and B+1 must be refused),
   then a decode job of the most rows accepted, each row its own sequence; ``max_rows``
   is the most rows whose job is correct (fewer are tried when it is not) — the figure
   the executor reads (:func:`calfsm.plan.batching.plan_batching`);
2. row independence: for several row counts up to ``max_rows``, a prefill of a different
   prompt per row (different lengths, so different positions), then ``--steps`` decode
   steps with the rows rotated between the job's row slots each step; each batch job
   alternates with the same rows run alone, one 1-row job each on a twin sequence. Every
   row's logits must be bit-exact with its twin's and with the reference model's; then
   every KV word of every row is probed by 1-row decodes (top position down), bit-exact
   with the twin's probe;
3. mixed rows: one prefill job whose rows have different lengths (one token, a few, more
   than a logits tile) and start positions (fresh sequences and continued ones), then
   one decode job whose rows are all at different positions, each row checked as in 2;
4. KV on failure, per scenario: prompts of different lengths (1-row jobs), then a batch
   continuation F of four tokens per row that fails — one row carries a ``total_seq`` the
   device must reject (that row alone ends ``DONE_CCU_EXCEPTION``, the job ``DONE_OK``);
   F's wait times out and F completes late; F's wait times out and the device is reset
   (the kinds that keep KV: CCU, configuration). Then every KV word F would have written
   is probed for every row, and each row's last prompt word.

On a calbin whose prefill graph carries one row (shape buckets: ``tiny-buckets``,
``qwen3-buckets``, whose decode graphs go up to 64 rows; the executor never batches a
prefill) the prefills of 2 and 3 run one row per job and the batch jobs are the decodes,
and F of 4 is one decode token per row; everything else is asked of the widest decode
graph as above.

Answers ``batch_rows_independent``, ``batch_mixed_rows`` and
``batch_kv_no_partial_update``; the observation ``max_rows`` is the real maximum. A
driver without the batch calls (``set_batch_rows``, ``row_status``, ``row=``) answers
all three "does not hold".
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from calfsm.drivers import Driver, refmodel
from calfsm.drivers.base import OutputStatus, ResetKind
from calfsm.errors import code_name
from calfsm.manifest import TaskKind, manifest_from_option
from calfsm.plan.capabilities import Verdict
from calfsm.tools.vendor_runner import Bench, Outcome, RunContext, Slot, run_runner

NAME = "batch_semantics"
#: the batch-8 form of the runners' default ``qwen3-b1``
DEFAULT_MANIFEST = "qwen3-b8"
CAPABILITIES = ("batch_rows_independent", "batch_mixed_rows", "batch_kv_no_partial_update")
#: the first KV sequence of each phase; a row's twin (the same row run alone) is ``+ TWIN``
SEQ_MAX_ROWS, SEQ_INDEPENDENT, SEQ_MIXED, SEQ_FAILURE = 1000, 2000, 3000, 4000
TWIN = 100_000
#: the failure phase: row ``r``'s prompt is ``PROMPT + r`` tokens, F adds ``CONTINUATION``
PROMPT, CONTINUATION = 3, 4
#: the probe token (``Bench.probe_word``'s)
PROBE_TOKEN = 1
#: problems listed per phase in the evidence (the count is always complete)
MAX_PROBLEMS = 12

_OK = OutputStatus.DONE_OK.name
_ROW_FAILED = OutputStatus.DONE_CCU_EXCEPTION.name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=3, metavar="N",
                   help="decode steps per row count in the independence phase, each "
                        "alternating with the rows run alone (default 3)")
    p.add_argument("--exec-timeout-s", type=float, default=0.0, metavar="S",
                   help="the execution deadline given to F's wait in the timeout "
                        "scenarios (default 0: already past, as after a long stall)")
    for action in p._actions:            # this runner's default: a batch calbin
        if action.dest == "manifest":
            action.default = DEFAULT_MANIFEST
            action.help = ("the model: a built-in name or a manifest file whose graphs are "
                           f"batch graphs (max_batch > 1; default {DEFAULT_MANIFEST}, "
                           "tiny-b8 for a fast run)")
            action.type = _batch_manifest


def _batch_manifest(spec: str) -> str:
    """``--manifest``'s check: a batch-1 manifest is bad usage (nothing is written); any
    other problem is left to the runner's own manifest error."""
    try:
        decode = manifest_from_option(spec, stage="runner").submodel(TaskKind.DECODE)
    except Exception:               # reported by run_runner, with its own message
        return spec
    if not decode.batched:
        raise argparse.ArgumentTypeError(
            f"{spec}: its decode graph has max_batch {decode.max_batch}; this runner asks "
            f"about batch graphs (max_batch > 1): use a batch calbin, e.g. "
            f"{DEFAULT_MANIFEST} or tiny-b8")
    return spec


def _name(rc: int) -> str:
    return code_name(rc) if rc else "SUCCESS"


@attrs.frozen
class Row:
    """One row of a job: ``tokens`` at ``start...`` on KV sequence ``seq``; ``total``
    overrides the ``total_seq`` CSR (a row the device must reject)."""

    seq: int
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    start: int
    total: int | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@attrs.define
class Job:
    """What one job did: its JSON observation, each row's logits row (a copy; empty when
    the job did not run), and whether each row is the reference model's."""

    obs: dict[str, Any]
    logits: list[np.ndarray]
    ok: list[bool]

    @property
    def ran(self) -> bool:
        return self.obs["code"] == "SUCCESS"


class Rows:
    """A batch graph's buffers (a :class:`~calfsm.tools.vendor_runner.Slot`), programmed row by
    row: row ``r`` of each tensor is ``[r, ...]`` (``docs/driver-protocol.md``, Batches)."""

    def __init__(self, bench: Bench, kind: TaskKind) -> None:
        self.bench, self.kind = bench, kind
        sub = bench.manifest.submodel(kind)
        self.slot: Slot = bench.slot(kind)
        self.batch = sub.max_batch
        self.width = sub.max_tokens
        self.pos_width = sub.position.element_count // self.batch
        self.tile = sub.rows
        self.vocab = sub.vocab
        self.csrs = (sub.csr_cur_seq, sub.csr_total_seq)
        self.logits = self.slot.logits.reshape(self.batch, self.tile, self.vocab)

    def program(self, rows: Sequence[Row]) -> tuple[str, int]:
        """Rows, then each row's tokens, positions, CSRs, sequence and KV; ``("", 0)`` or
        the first call that failed and its code."""
        d, inp = self.bench.driver, self.slot.inp
        if self.batch == 1:     # a one-row graph (a bucket calbin's prefill): sliced
            row = rows[0]
            return self.slot.program(row.seq, row.tokens, row.start, total=row.total)
        rc = int(d.set_batch_rows(inp, len(rows)))  # type: ignore[attr-defined]
        if rc:
            return "set_batch_rows", rc
        for r, row in enumerate(rows):
            n = len(row.tokens)
            self.slot.tok[r * self.width:r * self.width + n] = row.tokens
            self.slot.pos[r * self.pos_width:r * self.pos_width + n] = \
                np.arange(row.start, row.end)
            total = row.end if row.total is None else row.total
            for call, args in (("set_csr", (self.csrs[0], n)), ("set_csr", (self.csrs[1], total))):
                rc = int(d.set_csr(inp, *args, row=r))
                if rc:
                    return call, rc
            rc = int(d.set_kv_seq(inp, row.seq, row=r))
            if rc:
                return "set_kv_seq", rc
            if not d.kv_apply(row.seq, row.end):
                return "kv_apply", 1
        return "", 0

    def row_status(self, row: int) -> OutputStatus:
        return OutputStatus(self.bench.driver.row_status(self.slot.out, row))  # type: ignore[attr-defined]

    def row_logits(self, row: int, n: int) -> np.ndarray:
        """Row ``row``'s logits of the last of its ``n`` tokens."""
        return self.logits[row, refmodel.tile_row(n, self.tile) if self.tile > 1 else 0]

    def destroy(self) -> None:
        self.slot.destroy()


def start(buf: Rows, rows: Sequence[Row]) -> tuple[str, int]:
    """Program and submit (a sentinel in the output first); ``("", 0)`` or the failure."""
    buf.slot.fill()
    call, rc = buf.program(rows)
    if rc == 0:
        call, rc = "infer", buf.slot.submit()
    return call, rc


def finish(buf: Rows, rows: Sequence[Row], obs: dict[str, Any], *, record: bool = True
           ) -> Job:
    """After the job ended: its status, each row's, each row's logits against the
    reference model (the chain records the rows that are right), the padding rows."""
    b = buf.bench
    status = buf.slot.status()
    obs["status"] = status.name
    obs["row_status"] = [buf.row_status(r).name for r in range(len(rows))]
    pad = range(len(rows), buf.batch)
    obs["padding_clean"] = all(buf.row_status(r) is OutputStatus.IDLE for r in pad) and \
        (status is not OutputStatus.DONE_OK or not np.any(buf.logits[len(rows):]))
    logits, ok = [], []
    for r, row in enumerate(rows):
        got = buf.row_logits(r, len(row.tokens)).copy()
        want = b.chain.hashes(row.seq, row.tokens, row.start)[-1]
        good = status is OutputStatus.DONE_OK and obs["row_status"][r] == _OK \
            and np.array_equal(got, refmodel.logits_bf16(want, buf.vocab))
        if good and record:
            b.chain.record(row.seq, row.tokens, row.start)
        logits.append(got)
        ok.append(bool(good))
    obs["correct"] = ok
    return Job(obs, logits, ok)


def run(buf: Rows, rows: Sequence[Row], *, record: bool = True) -> Job:
    """One whole job of ``rows`` on ``buf``: program, submit, wait, judge."""
    obs: dict[str, Any] = {"rows": len(rows), "seqs": [r.seq for r in rows],
                           "starts": [r.start for r in rows],
                           "lengths": [len(r.tokens) for r in rows]}
    call, rc = start(buf, rows)
    if rc == 0:
        call, rc = "wait", buf.slot.wait()
    obs["code"] = f"{call}: {_name(rc)}" if rc else "SUCCESS"
    if rc:
        return Job(obs, [], [False] * len(rows))
    return finish(buf, rows, obs, record=record)


def probe(dec: Rows, seq: int, pos: int, candidates: dict[str, int]
          ) -> tuple[str, np.ndarray | None]:
    """Which candidate the KV word of ``seq`` at ``pos`` is, read by a 1-row decode at
    ``pos + 1`` (which writes ``pos + 1``: probe top down), and the logits it read (None
    when the probe job failed); as :meth:`~calfsm.tools.vendor_runner.Bench.probe_word`."""
    job = run(dec, [Row(seq, [PROBE_TOKEN], pos + 1)], record=False)
    if not job.ran:
        return job.obs["code"], None
    if job.obs["status"] != _OK or job.obs["row_status"][0] != _OK:
        return f"status {job.obs['status']}/{job.obs['row_status'][0]}", None
    got = job.logits[0]
    for name, word in candidates.items():
        h = refmodel.step(word, PROBE_TOKEN, pos + 1)
        if np.array_equal(got, refmodel.logits_bf16(h, dec.vocab)):
            return name, got
    return "other", got


class Problems:
    """A phase's problems: the first :data:`MAX_PROBLEMS` named, all counted."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.count = 0
        #: batch jobs whose padding rows were not IDLE with zero logits (no verdict)
        self.padding_dirty = 0

    def add(self, text: str) -> None:
        self.count += 1
        if len(self.items) < MAX_PROBLEMS:
            self.items.append(text)

    def __bool__(self) -> bool:
        return self.count > 0

    def to_obs(self) -> dict[str, Any]:
        return {"problems": self.count, "first_problems": self.items,
                "padding_not_clean": self.padding_dirty}

    def first(self, n: int = 3) -> str:
        more = f" (and {self.count - n} more)" if self.count > n else ""
        return "; ".join(self.items[:n]) + more


def release(bench: Bench, seqs: Sequence[int]) -> None:
    for seq in seqs:
        bench.driver.kv_release(seq, 0)
        bench.chain.forget(seq)


def compare(where: str, batch: Job, alone: Sequence[Job], rows: Sequence[Row],
            problems: Problems) -> None:
    """Every row of ``batch`` against the reference model and the same row run alone."""
    if not batch.ran:
        problems.add(f"{where}: the batch job failed: {batch.obs['code']}")
        return
    if batch.obs["status"] != _OK:
        problems.add(f"{where}: the batch job ended {batch.obs['status']}")
        return
    if not batch.obs["padding_clean"]:
        problems.padding_dirty += 1
    for r, (row, twin) in enumerate(zip(rows, alone, strict=True)):
        at = f"{where}, row {r} (seq {row.seq}, {len(row.tokens)} token(s) at {row.start})"
        if not twin.ran or not twin.ok[0]:
            problems.add(f"{at}: the same row alone is wrong itself "
                         f"({twin.obs['code']}, {twin.obs.get('row_status')})")
        elif batch.obs["row_status"][r] != _OK:
            problems.add(f"{at}: row status {batch.obs['row_status'][r]}")
        elif not np.array_equal(batch.logits[r], twin.logits[0]):
            problems.add(f"{at}: logits differ from the same row run alone")
        elif not batch.ok[r]:
            problems.add(f"{at}: logits differ from the reference model")


def probe_all(dec: Rows, seqs: Sequence[int], twins: Sequence[int], ends: Sequence[int],
              where: str, problems: Problems) -> int:
    """Every KV word ``0 .. end-1`` of each sequence and of its twin, top down: the word
    the row run alone wrote (the twin's chain: after a wrong batch step the sequence's
    own chain is behind), and the sequence's probe bit-exact with the twin's. The probes
    made."""
    b, made = dec.bench, 0
    for seq, twin, end in zip(seqs, twins, ends, strict=True):
        words = {p: b.chain.word(twin, p) for p in range(end)}
        for p in reversed(range(end)):
            got, mine = probe(dec, seq, p, {"written": words[p]})
            ref, theirs = probe(dec, twin, p, {"written": words[p]})
            made += 2
            if got != "written" or ref != "written" or mine is None or theirs is None \
                    or not np.array_equal(mine, theirs):
                problems.add(f"{where}: seq {seq} KV word at {p} is {got!r}, its twin's "
                             f"{ref!r}")
    return made


# ---------------------------------------------------------------------------------------
# 1. the real maximum rows


def max_rows(ctx: RunContext, batch: int) -> dict[str, Any]:
    b, d = ctx.bench, ctx.driver
    dec = Rows(b, TaskKind.DECODE)
    obs: dict[str, Any] = {"batch": batch}
    codes = {k: _name(int(d.set_batch_rows(dec.slot.inp, k)))  # type: ignore[attr-defined]
             for k in range(batch + 2)}
    obs["set_batch_rows"] = {str(k): c for k, c in codes.items()}
    accepted = 0
    while accepted + 1 <= batch + 1 and codes[accepted + 1] == "SUCCESS":
        accepted += 1
    obs["accepted"] = accepted
    obs["refuses_zero"] = codes[0] != "SUCCESS"
    obs["refuses_more_than_batch"] = codes[batch + 1] != "SUCCESS"
    obs["set_kv_seq_row_batch"] = _name(int(d.set_kv_seq(dec.slot.inp, SEQ_MAX_ROWS, row=batch)))
    obs["set_csr_row_batch"] = _name(int(d.set_csr(dec.slot.inp, dec.csrs[0], 1, row=batch)))
    obs["set_batch_rows_output"] = _name(int(d.set_batch_rows(dec.slot.out, 1)))  # type: ignore[attr-defined]
    d.set_batch_rows(dec.slot.inp, 1)  # type: ignore[attr-defined]
    trials, found, seqs = [], 0, []
    for k in range(min(accepted, batch), 0, -1):
        rows = [Row(SEQ_MAX_ROWS + 100 * len(trials) + r, [(7 * r + 3) % dec.vocab], 0)
                for r in range(k)]
        seqs += [r.seq for r in rows]
        job = run(dec, rows)
        trials.append({"rows": k, "code": job.obs["code"], "status": job.obs.get("status"),
                       "row_status": job.obs.get("row_status"), "correct": job.ok})
        if job.ran and all(job.ok):
            found = k
            break
    obs["row_status_row_batch"] = dec.row_status(batch).name
    if batch >= 2:     # two rows naming one sequence: refused at infer
        rows = [Row(SEQ_MAX_ROWS + 99, [5], 0), Row(SEQ_MAX_ROWS + 99, [6], 0)]
        call, rc = start(dec, rows)
        if rc == 0:
            dec.slot.wait()
        obs["duplicate_seq"] = f"{call}: {_name(rc)}" if rc else "SUCCESS"
        seqs.append(SEQ_MAX_ROWS + 99)
        # a row below rows without its sequence and CSRs: refused at infer
        fresh = Rows(b, TaskKind.DECODE)
        call, rc = fresh.program([Row(SEQ_MAX_ROWS + 98, [5], 0)])
        if rc == 0:
            rc = int(d.set_batch_rows(fresh.slot.inp, 2))  # type: ignore[attr-defined]
        if rc == 0:
            call, rc = "infer", fresh.slot.submit()
            if rc == 0:
                fresh.slot.wait()
        obs["missing_row_config"] = f"{call}: {_name(rc)}" if rc else "SUCCESS"
        seqs.append(SEQ_MAX_ROWS + 98)
        fresh.destroy()
    obs["trials"] = trials
    obs["max_rows"] = found
    dec.destroy()
    release(b, seqs)
    return obs


# ---------------------------------------------------------------------------------------
# 2. row independence


def prefill_rows(b: Bench) -> bool:
    """Whether the prefill graph carries several rows (else prefills go one per job)."""
    return b.manifest.submodel(TaskKind.PREFILL_IDS).batched


def run_prefills(pre: Rows, alone: Rows, rows: Sequence[Row], where: str,
                 problems: Problems) -> None:
    """Prefill ``rows`` one per job on a one-row prefill graph (and each twin alone),
    each compared as a batch row is."""
    for row in rows:
        job = run(pre, [row])
        twin = run(alone, [attrs.evolve(row, seq=row.seq + TWIN)])
        compare(f"{where} (one row per job)", job, [twin], [row], problems)


def row_counts(most: int) -> list[int]:
    """Several row counts up to ``most``: 2, 3, about half, all."""
    return sorted({c for c in (2, 3, (most + 1) // 2, most) if 2 <= c <= most})


def independence(ctx: RunContext, most: int, steps: int) -> dict[str, Any]:
    b = ctx.bench
    pre, dec = Rows(b, TaskKind.PREFILL_IDS), Rows(b, TaskKind.DECODE)
    alone_pre, alone_dec = Rows(b, TaskKind.PREFILL_IDS), Rows(b, TaskKind.DECODE)
    problems = Problems()
    runs, ids = [], itertools.count(SEQ_INDEPENDENT)
    jobs = probes = 0
    for k in row_counts(most):
        seqs = [next(ids) for _ in range(k)]
        twins = [s + TWIN for s in seqs]
        lengths = [2 + (5 * r + k) % 11 for r in range(k)]
        current = [Row(s, b.prompt(s, n), 0) for s, n in zip(seqs, lengths, strict=True)]
        for step in range(steps + 1):
            if step:
                current = [Row(row.seq, [(r * 131 + step * 17 + k * 7 + 3) % dec.vocab],
                               row.end) for r, row in enumerate(current)]
            # the rows move between row slots each step: the KV follows the sequence
            order = [current[(i + step) % k] for i in range(k)]
            if step == 0 and not prefill_rows(b):
                run_prefills(pre, alone_pre, order, f"{k} rows, step 0", problems)
                jobs += 2 * k
                continue
            buf, alone = (pre, alone_pre) if step == 0 else (dec, alone_dec)
            batch = run(buf, order)
            twin = [run(alone, [attrs.evolve(row, seq=row.seq + TWIN)]) for row in order]
            jobs += 1 + k
            compare(f"{k} rows, step {step}", batch, twin, order, problems)
        ends = [row.end for row in current]
        probes += probe_all(alone_dec, seqs, twins, ends, f"{k} rows", problems)
        runs.append({"rows": k, "prompt_lengths": lengths, "final_positions": ends})
        release(b, seqs + twins)
    for buf in (pre, dec, alone_pre, alone_dec):
        buf.destroy()
    return {"counts": runs, "steps": steps, "jobs": jobs, "probes": probes,
            **problems.to_obs(), "_problems": problems}


# ---------------------------------------------------------------------------------------
# 3. mixed rows


def patterns(tile: int) -> list[tuple[int, int]]:
    """(tokens already in the sequence, tokens of the mixed prefill) per row: fresh and
    continued sequences, one token, a few, more than a tile; every row then decodes at
    a different position."""
    return [(0, 5), (7, 3), (3, 1), (0, tile + 3), (2, tile + 2), (11, 2), (1, 2 * tile),
            (8, 1)]


def mixed(ctx: RunContext, most: int) -> dict[str, Any]:
    b = ctx.bench
    pre, dec = Rows(b, TaskKind.PREFILL_IDS), Rows(b, TaskKind.DECODE)
    alone_pre, alone_dec = Rows(b, TaskKind.PREFILL_IDS), Rows(b, TaskKind.DECODE)
    problems = Problems()
    pats = list(itertools.islice(itertools.cycle(patterns(pre.tile)), most))
    pats = [(p, max(1, min(n, pre.width))) for p, n in pats]     # a short prefill graph
    seqs = [SEQ_MIXED + r for r in range(most)]
    twins = [s + TWIN for s in seqs]
    for seq, (prefix, _n) in zip(seqs, pats, strict=True):
        if prefix:
            for s in (seq, seq + TWIN):
                job = run(alone_pre, [Row(s, b.prompt(seq, prefix), 0)])
                if not (job.ran and job.ok[0]):
                    problems.add(f"seq {s}: its {prefix}-token prefix alone failed "
                                 f"({job.obs['code']}, {job.obs.get('row_status')})")
    obs: dict[str, Any] = {"rows": most}
    if not problems:
        rows = [Row(s, b.prompt(s, n, offset=1), p)
                for s, (p, n) in zip(seqs, pats, strict=True)]
        obs["prefill"] = {"lengths": [len(r.tokens) for r in rows],
                          "starts": [r.start for r in rows], "batched": prefill_rows(b)}
        if prefill_rows(b):
            batch = run(pre, rows)
            twin = [run(alone_pre, [attrs.evolve(r, seq=r.seq + TWIN)]) for r in rows]
            compare("mixed prefill", batch, twin, rows, problems)
        else:
            run_prefills(pre, alone_pre, rows, "mixed prefill", problems)
        rows = [Row(r.seq, [(11 * i + 5) % dec.vocab], r.end) for i, r in enumerate(rows)]
        obs["decode"] = {"positions": [r.start for r in rows]}
        batch = run(dec, rows)
        twin = [run(alone_dec, [attrs.evolve(r, seq=r.seq + TWIN)]) for r in rows]
        compare("mixed decode", batch, twin, rows, problems)
        obs["probes"] = probe_all(alone_dec, seqs, twins, [r.end for r in rows],
                                  "mixed", problems)
    release(b, seqs + twins)
    for buf in (pre, dec, alone_pre, alone_dec):
        buf.destroy()
    return {**obs, **problems.to_obs(), "_problems": problems}


# ---------------------------------------------------------------------------------------
# 4. KV on failure


def _kv_outcome(seen: set[str]) -> str:
    return ("complete" if seen == {"written"} else "untouched" if seen == {"unwritten"}
            else "partial" if seen == {"written", "unwritten"} else "corrupt")


def failure(ctx: RunContext, name: str, index: int, k: int) -> dict[str, Any]:
    b, d = ctx.bench, ctx.driver
    obs: dict[str, Any] = {"scenario": name, "rows": k}
    lost, rc = b.ensure_configured()
    if rc:
        return {**obs, "error": f"configure: {_name(rc)}"}
    seqs = [SEQ_FAILURE + 100 * index + r for r in range(k)]
    prompts = [PROMPT + r for r in range(k)]
    alone = Rows(b, TaskKind.PREFILL_IDS)
    for seq, n in zip(seqs, prompts, strict=True):
        job = run(alone, [Row(seq, b.prompt(seq, n), 0)])
        if not (job.ran and job.ok[0]):
            alone.destroy()
            release(b, seqs)
            return {**obs, "error": f"the prompt of seq {seq} failed alone "
                                    f"({job.obs['code']}, {job.obs.get('row_status')})"}
    alone.destroy()
    rejected = name == "row_rejected"
    bad = k // 2 if rejected else None       # the row the device must reject
    # F: a prefill continuation of CONTINUATION tokens per row, or one decode token
    # where the prefill graph carries one row
    cont, f_kind = (CONTINUATION, TaskKind.PREFILL_IDS) if prefill_rows(b) \
        else (1, TaskKind.DECODE)
    rows = [Row(seq, b.prompt(seq, cont, offset=1), n,
                total=n + cont + 1 if r == bad else None)
            for r, (seq, n) in enumerate(zip(seqs, prompts, strict=True))]
    obs["rejected_row"] = bad
    f = Rows(b, f_kind)
    call, rc = start(f, rows)
    obs["submit"] = f"{call}: {_name(rc)}" if rc else "SUCCESS"
    if rc:
        f.destroy()
        release(b, seqs)
        return {**obs, "error": f"F could not be submitted: {obs['submit']}"}
    if rejected:
        obs["wait"] = _name(f.slot.wait())
    else:
        rc = f.slot.wait(ctx.args.exec_timeout_s)
        obs["wait"] = _name(rc)
        if rc:          # still pending (a real device may have finished since)
            obs["status_pending"] = f.slot.status().name
            obs["row_status_pending"] = [f.row_status(r).name for r in range(k)]
            obs["set_batch_rows_pending"] = _name(int(d.set_batch_rows(  # type: ignore[attr-defined]
                f.slot.inp, k)))
        if rc == 0:
            f.slot.wait()
            f.destroy()
            release(b, seqs)
            return {**obs, "error": "F finished inside the execution deadline"}
        if name == "timeout_then_late_completion":
            obs["wait_again"] = _name(f.slot.wait())
        else:
            kind = ResetKind(name.removeprefix("timeout_then_reset_"))
            obs["reset"] = _name(d.reset(kind))
            b.settle(0.05)
            lost, rc = b.ensure_configured()
            obs["configuration_lost"] = lost
            if rc:
                return {**obs, "error": f"configure after the reset: {_name(rc)}"}
    job = finish(f, rows, obs, record=False)
    failed_rows = [r for r, s in enumerate(obs["row_status"]) if s == _ROW_FAILED]
    if obs["status"] == _OK:
        obs["failed_rows_logits_zero"] = all(not np.any(f.logits[r]) for r in failed_rows)
    f.destroy()                     # after a configuration reset: stale, refused
    dec = Rows(b, TaskKind.DECODE)
    per_row, problems = [], []
    for r, row in enumerate(rows):
        written = b.chain.hashes(row.seq, row.tokens, row.start)
        words = {row.start + i: probe(dec, row.seq, row.start + i,
                                      {"written": written[i], "unwritten": 0})[0]
                 for i in reversed(range(cont))}
        prefix = probe(dec, row.seq, row.start - 1,
                       {"intact": b.chain.word(row.seq, row.start - 1), "unwritten": 0})[0]
        outcome = _kv_outcome(set(words.values()))
        status = obs["row_status"][r]
        per_row.append({"row": r, "seq": row.seq, "row_status": status,
                        "correct": job.ok[r], "f_positions": dict(sorted(words.items())),
                        "prefix_last_word": prefix, "outcome": outcome})
        at = f"{name}, row {r} ({status})"
        if prefix != "intact":
            problems.append(f"{at}: its prompt's KV is {prefix}")
        if outcome not in ("complete", "untouched"):
            problems.append(f"{at}: F's KV is {outcome} ({words})")
        elif status == _ROW_FAILED and obs["status"] == _OK and outcome != "untouched":
            problems.append(f"{at}: a failed row wrote its KV")
        elif status == _OK and outcome != "complete":
            problems.append(f"{at}: a row that ended DONE_OK left its KV untouched")
    dec.destroy()
    release(b, seqs)
    obs.update(per_row=per_row, problems=problems,
               outcomes=[p["outcome"] for p in per_row])
    if rejected and bad is not None and obs["row_status"][bad] == _OK:
        obs["error"] = (f"the device ran row {bad} with total_seq {rows[bad].total} "
                        f"(want {rows[bad].end}): no row failed")
    return obs


def failures(ctx: RunContext, k: int) -> list[dict[str, Any]]:
    caps = ctx.driver.capabilities()
    names = ["row_rejected", "timeout_then_late_completion",
             *(f"timeout_then_reset_{kind.value}" for kind in (ResetKind.CCU,
                                                               ResetKind.CONFIGURATION)
               if caps.can_reset(kind))]
    return [failure(ctx, n, i, k) for i, n in enumerate(names)]


# ---------------------------------------------------------------------------------------
# deciding


def missing_batch_calls(driver: Driver) -> str | None:
    """Why ``driver`` cannot run a batch job through the protocol, or None."""
    absent = [m for m in ("set_batch_rows", "row_status")
              if not callable(getattr(driver, m, None))]
    for m in ("set_kv_seq", "set_csr"):
        try:
            if "row" not in inspect.signature(getattr(driver, m)).parameters:
                absent.append(f"{m}(row=)")
        except (TypeError, ValueError):
            pass                       # no signature to read: the calls will tell
    if not absent:
        return None
    return f"driver {driver.name!r} has no batch calls ({', '.join(absent)})"


def decide(obs: dict[str, Any]) -> tuple[dict[str, Verdict], bool]:
    """The verdicts and whether every observation was made."""
    m = obs["max_rows"]
    most, batch = m["max_rows"], m["batch"]
    head = (f"max rows {most} of {batch} (set_batch_rows accepts 1..{m['accepted']}, "
            f"{batch + 1}: {m['set_batch_rows'][str(batch + 1)]})")
    if most < 2:
        why = f"{head}: no job of two or more rows ran correctly " \
              f"({[(t['rows'], t['code'], t['status']) for t in m['trials']]})"
        return {c: Verdict(False, why) for c in CAPABILITIES}, True
    ind: Problems = obs["independence"]["_problems"]
    counts = [c["rows"] for c in obs["independence"]["counts"]]
    if ind or not m["refuses_more_than_batch"]:
        extra = "" if m["refuses_more_than_batch"] else \
            f"; set_batch_rows({batch + 1}) was accepted by a graph of {batch} rows"
        independent = Verdict(False, f"{head}: {ind.count} problem(s) over "
                                     f"{obs['independence']['jobs']} jobs: {ind.first()}"
                                     f"{extra}")
    else:
        independent = Verdict(True, f"{head}; rows {counts}, a prefill and "
                                    f"{obs['independence']['steps']} rotated decode steps "
                                    f"each: every row's logits and its "
                                    f"{obs['independence']['probes']} probed KV words "
                                    "bit-exact with the same row run alone")
    mix = obs["mixed"]
    mp: Problems = mix["_problems"]
    if mp:
        mixed_v = Verdict(False, f"{mp.count} problem(s) with {mix['rows']} mixed rows: "
                                 f"{mp.first()}")
    else:
        how = "one prefill" if mix["prefill"].get("batched", True) else "prefills"
        mixed_v = Verdict(True, f"{how} of {mix['rows']} rows, lengths "
                                f"{mix['prefill']['lengths']} at starts "
                                f"{mix['prefill']['starts']}, and one decode at positions "
                                f"{mix['decode']['positions']}: every row bit-exact with "
                                "the same row alone, logits and KV")
    runs = obs["failures"]
    done = [r for r in runs if "error" not in r]
    lines = [f"{r['scenario']}: " + (f"not observed ({r['error']})" if "error" in r else
                                     f"wait {r['wait']}, job {r['status']}, rows "
                                     f"{_compact(r['row_status'])}, their KV "
                                     f"{_compact(r['outcomes'])}") for r in runs]
    bad = [p for r in done for p in r["problems"]]
    holds = bool(done) and not bad
    kv = Verdict(holds, ("every row's KV untouched or fully written in every scenario, "
                         "a failed row's untouched, every prompt intact" if holds else
                         f"{len(bad)} problem(s): {'; '.join(bad[:3])}")
                 + " — " + "; ".join(lines))
    verdicts = {"batch_rows_independent": independent, "batch_mixed_rows": mixed_v}
    # a partial update seen in any scenario is an answer; "never partial" needs them all
    if len(done) == len(runs) or (done and not holds):
        verdicts["batch_kv_no_partial_update"] = kv
    return verdicts, len(done) == len(runs)


def _compact(items: Sequence[Any]) -> str:
    """``[DONE_OK x3, DONE_CCU_EXCEPTION, DONE_OK x4]``: runs of equal items."""
    parts = []
    for item, group in itertools.groupby(items):
        n = len(list(group))
        parts.append(f"{item}" + (f" x{n}" if n > 1 else ""))
    return "[" + ", ".join(parts) + "]"


def _deviations(obs: dict[str, Any]) -> Iterator[str]:
    """What the device did that docs/driver-protocol.md (Batches) says it does not (none
    of it decides a verdict)."""
    m = obs["max_rows"]
    if not m["refuses_zero"]:
        yield "set_batch_rows(0) was accepted"
    for key in ("set_kv_seq_row_batch", "set_csr_row_batch"):
        if m[key] != "INVALID_VALUE":
            yield f"{key.removesuffix('_row_batch')}(row=B) returned {m[key]}"
    if m.get("duplicate_seq", "infer: INVALID_VALUE") != "infer: INVALID_VALUE":
        yield f"two rows naming one sequence: {m['duplicate_seq']}"
    if m.get("missing_row_config", "infer: MISSING_CONFIG") != "infer: MISSING_CONFIG":
        yield f"row 1 of 2 without its sequence and CSRs: {m['missing_row_config']}"
    if m["set_batch_rows_output"] != "WRONG_DIRECTION":
        yield f"set_batch_rows on an output buffer returned {m['set_batch_rows_output']}"
    if m["row_status_row_batch"] != OutputStatus.IDLE.name:
        yield f"row_status(out, B) is {m['row_status_row_batch']}, not IDLE"
    for phase in ("independence", "mixed"):
        if obs.get(phase, {}).get("padding_not_clean"):
            yield (f"{phase}: {obs[phase]['padding_not_clean']} job(s) whose padding rows "
                   "were not IDLE with zero logits")
    for r in obs["failures"]:
        if r.get("status") not in (None, _OK) and r["scenario"] == "row_rejected":
            yield f"a row's failed check failed the whole job ({r['status']})"
        if r.get("failed_rows_logits_zero") is False:
            yield f"{r['scenario']}: a failed row's logits are not zeros"
        if r.get("padding_clean") is False:
            yield f"{r['scenario']}: padding rows not IDLE with zero logits"
        if r.get("status_pending") != OutputStatus.PENDING.name:
            continue
        if any(x != OutputStatus.PENDING.name for x in r["row_status_pending"]):
            yield f"{r['scenario']}: rows of a pending job: {r['row_status_pending']}"
        if r["set_batch_rows_pending"] != "DEVICE_BUSY":
            yield (f"{r['scenario']}: set_batch_rows with the job pending returned "
                   f"{r['set_batch_rows_pending']}")


def observe(ctx: RunContext) -> Outcome:
    d, args = ctx.driver, ctx.args
    decode = ctx.manifest.submodel(TaskKind.DECODE)
    obs: dict[str, Any] = {"batch": decode.max_batch,
                           "declared": {"batch_rows": d.capabilities().batch_rows}}
    missing = missing_batch_calls(d)
    if missing is not None:
        obs["max_rows"] = 1
        return Outcome(obs, {c: Verdict(False, missing) for c in CAPABILITIES},
                       [f"- {missing}"])
    m = obs["max_rows_probe"] = max_rows(ctx, decode.max_batch)
    obs["max_rows"] = m["max_rows"]
    if m["max_rows"] >= 2:
        obs["independence"] = independence(ctx, m["max_rows"], max(args.steps, 1))
        obs["mixed"] = mixed(ctx, m["max_rows"])
        obs["failures"] = failures(ctx, m["max_rows"])
    else:
        obs["failures"] = []
    verdicts, complete = decide({**obs, "max_rows": m})
    obs["protocol_deviations"] = list(_deviations({**obs, "max_rows": m}))
    for phase in ("independence", "mixed"):
        obs.get(phase, {}).pop("_problems", None)
    summary = [f"- max rows: {m['max_rows']} of {m['batch']} "
               f"(set_batch_rows accepts 1..{m['accepted']})"]
    if "independence" in obs:
        i, x = obs["independence"], obs["mixed"]
        summary += [f"- independence: rows {[c['rows'] for c in i['counts']]}, {i['jobs']} "
                    f"jobs, {i['probes']} probes, {i['problems']} problem(s)",
                    f"- mixed rows: {x['rows']} rows, {x['problems']} problem(s)"]
    summary += [f"- {r['scenario']}: " + (f"not observed ({r['error']})" if "error" in r
                                          else f"rows {_compact(r['row_status'])}, KV "
                                               f"{_compact(r['outcomes'])}")
                for r in obs["failures"]]
    summary += [f"- protocol deviation: {x}" for x in obs["protocol_deviations"]]
    return Outcome(obs, verdicts, summary, complete=complete)


def main(argv: list[str] | None = None, *, driver: Driver | None = None) -> int:
    return run_runner(NAME, __doc__.splitlines()[0], observe, argv, add_arguments,
                      driver=driver)


if __name__ == "__main__":
    sys.exit(main())
