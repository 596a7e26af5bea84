"""Vendor runner: what does a step of each graph cost, and can a sequence move between graphs?
(issue 36; spec section 14)

A calbin with shape buckets (several decode graphs of one kind, ``(kind, max_batch,
max_seq)``: docs/driver-protocol.md, Shape buckets) lets the executor run each step on
the cheapest graph that covers it. What "cheapest" means is the device's to say, so this
runner measures, on the device's own clock, per decode graph:

1. **rows**: a decode step carrying 1, 2, 4, ... rows up to the graph's ``max_batch``
   (median of ``--repeats``; every row's logits checked against the reference model);
2. **context**: a one-row step whose ``total_seq`` is short, then longer (up to
   ``--max-context``), the slope per context token fitted (a static graph attends over
   its whole window: about 0; a dynamic one: what each token adds);

and per prefill graph the seconds per prefilled token (two prompt lengths). Then
**KV continuity**: one sequence decoded step by step on every decode graph in turn
(alone, then as the last row beside another sequence), against the same prompt decoded
on the widest graph alone: every step's logits must be bit-exact (and the reference
model's).

Verdicts: ``graph_step_costs`` holds when every graph was measured with every output
right; ``graph_kv_continuity`` when every moved step equals the step that stayed. The
observation ``step_costs`` (:func:`calfsm.plan.buckets.step_costs_observation`) is what
the executor plans with (``calfsm capabilities`` shows the verdicts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from calfsm.drivers import Driver, refmodel
from calfsm.drivers.base import OutputStatus
from calfsm.errors import code_name
from calfsm.manifest import SubmodelContract, TaskKind
from calfsm.plan.buckets import graph_cost_record, step_costs_observation
from calfsm.plan.capabilities import Verdict
from calfsm.tools.vendor_runner import Bench, Outcome, RunContext, Slot, run_runner

NAME = "step_costs"
#: the bucket form of the runners' default ``qwen3-b1``
DEFAULT_MANIFEST = "qwen3-buckets"
#: the first KV sequence of each phase
SEQ_ROWS, SEQ_CONTEXT, SEQ_MOVE, SEQ_STAY, SEQ_PREFILL = 5000, 6000, 7000, 7001, 7100
PROMPT = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="steps timed per point, the median kept (default 3)")
    p.add_argument("--max-context", type=int, default=2048, metavar="TOKENS",
                   help="the longest context the context sweep prefills (default 2048)")
    p.add_argument("--move-steps", type=int, default=0, metavar="N",
                   help="decode steps of the continuity check (default: two per graph)")
    for action in p._actions:            # this runner's default: a bucket calbin
        if action.dest == "manifest":
            action.default = DEFAULT_MANIFEST
            action.help = ("the model: a built-in name or a manifest file, best one with "
                           f"shape buckets (default {DEFAULT_MANIFEST}, tiny-buckets for a "
                           "fast run)")


class Graph:
    """One graph's buffers (a :class:`~calfsm.tools.vendor_runner.Slot`), programmed row by
    row as ``docs/driver-protocol.md``, Batches, says."""

    def __init__(self, bench: Bench, sub: SubmodelContract) -> None:
        self.bench, self.sub = bench, sub
        self.slot: Slot = bench.slot(sub.kind, graph=sub)
        self.batch = sub.max_batch
        self.width = sub.max_tokens
        self.tile = sub.rows
        self.logits = self.slot.logits.reshape(self.batch, self.tile, sub.vocab)

    def program(self, rows: Sequence[tuple[int, Sequence[int], int]]) -> tuple[str, int]:
        """``rows``: (sequence, tokens, start) each; ``("", 0)`` or the failing call."""
        d, inp, sub = self.bench.driver, self.slot.inp, self.sub
        if sub.batched:
            rc = int(d.set_batch_rows(inp, len(rows)))  # type: ignore[attr-defined]
            if rc:
                return "set_batch_rows", rc
        for r, (seq, tokens, start) in enumerate(rows):
            n = len(tokens)
            self.slot.tok[r * self.width:r * self.width + n] = tokens
            self.slot.pos[r * self.width:r * self.width + n] = np.arange(start, start + n)
            where = {"row": r} if sub.batched else {}
            if not sub.batched and sub.kind is not TaskKind.DECODE:
                for name in (sub.token_or_embed.name, sub.position.name):
                    rc = int(d.slice_tensor(inp, name, 0, 4 * n))
                    if rc:
                        return "slice_tensor", rc
            for name, value in ((sub.csr_cur_seq, n), (sub.csr_total_seq, start + n)):
                rc = int(d.set_csr(inp, name, value, **where))
                if rc:
                    return "set_csr", rc
            rc = int(d.set_kv_seq(inp, seq, **where))
            if rc:
                return "set_kv_seq", rc
            if not d.kv_apply(seq, start + n):
                return "kv_apply", 1
        return "", 0

    def step(self, rows: Sequence[tuple[int, Sequence[int], int]]
             ) -> tuple[float | None, list[np.ndarray], str]:
        """One job: its seconds on the device's clock (infer to wait), each row's logits
        of its last token, and ``"SUCCESS"`` or what failed."""
        clock, d = self.bench.driver.clock, self.bench.driver
        call, rc = self.program(rows)
        t0 = clock.now()
        if rc == 0:
            call, rc = "infer", self.slot.submit()
        if rc == 0:
            call, rc = "wait", self.slot.wait()
        took = clock.now() - t0
        if not self.sub.batched and self.sub.kind is not TaskKind.DECODE:
            for name in (self.sub.token_or_embed.name, self.sub.position.name):
                d.undo_slice(self.slot.inp, name)
        if rc:
            return None, [], f"{call}: {code_name(rc)}"
        status = OutputStatus(d.status(self.slot.out))
        if status is not OutputStatus.DONE_OK:
            return None, [], f"status {status.name}"
        out = [self.logits[r, refmodel.tile_row(len(t), self.tile) if self.tile > 1 else 0]
               .copy() for r, (_s, t, _p) in enumerate(rows)]
        return took, out, "SUCCESS"

    def destroy(self) -> None:
        self.slot.destroy()


class Run:
    """The reference chain of every sequence, and every problem seen."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.bench = ctx.bench
        self.vocab = ctx.manifest.submodel(TaskKind.DECODE).vocab
        self.problems: list[str] = []
        self.prefill = Graph(self.bench, ctx.manifest.submodel(TaskKind.PREFILL_IDS))
        self.pos: dict[int, int] = {}

    def right(self, seq: int, tokens: Sequence[int], start: int, got: np.ndarray) -> bool:
        want = self.bench.chain.hashes(seq, tokens, start)[-1]
        if np.array_equal(got, refmodel.logits_bf16(want, self.vocab)):
            self.bench.chain.record(seq, tokens, start)
            return True
        self.problems.append(f"seq {seq} at {start}: logits differ from the reference")
        return False

    def start(self, seq: int, n: int, like: int | None = None) -> tuple[float | None, bool]:
        """Prefill ``seq`` with a prompt of ``n`` tokens (chunked by the graph): its own,
        or ``like``'s (the same prompt as that sequence)."""
        self.release(seq)
        prompt = self.bench.prompt(seq if like is None else like, n)
        width, done, took, ok = self.prefill.width, 0, 0.0, True
        while done < n:
            chunk = prompt[done:done + width]
            t, out, what = self.prefill.step([(seq, chunk, done)])
            if t is None:
                self.problems.append(f"prefill of seq {seq}: {what}")
                return None, False
            ok = self.right(seq, chunk, done, out[0]) and ok
            took += t
            done += len(chunk)
        self.pos[seq] = n
        return took, ok

    def token(self, seq: int) -> int:
        return (seq * 13 + self.pos[seq] * 7 + 1) % self.vocab

    def release(self, seq: int) -> None:
        self.bench.driver.kv_release(seq, 0)
        self.bench.chain.forget(seq)
        self.pos.pop(seq, None)

    def decode(self, g: Graph, seqs: Sequence[int]) -> tuple[float | None, list[np.ndarray]]:
        """One decode step of ``seqs`` (one row each) on ``g``, judged row by row."""
        rows = [(s, [self.token(s)], self.pos[s]) for s in seqs]
        took, out, what = g.step(rows)
        if took is None:
            self.problems.append(f"{g.sub.exact_name}, {len(rows)} rows: {what}")
            return None, []
        for (s, t, p), row in zip(rows, out, strict=True):
            self.right(s, t, p, row)
            self.pos[s] = p + 1
        return took, out


def row_counts(batch: int) -> list[int]:
    counts, r = [], 1
    while r < batch:
        counts.append(r)
        r *= 2
    return [*counts, batch]


def measure_rows(run: Run, g: Graph, repeats: int) -> dict[int, float]:
    seqs = [SEQ_ROWS + i for i in range(g.batch)]
    for s in seqs:
        run.start(s, PROMPT)
    costs: dict[int, float] = {}
    for rows in row_counts(g.batch):
        times = [t for t, _ in (run.decode(g, seqs[:rows]) for _ in range(repeats))
                 if t is not None]
        if times:
            costs[rows] = statistics.median(times)
    for s in seqs:
        run.release(s)
    return costs


def measure_context(run: Run, g: Graph, repeats: int, longest: int
                    ) -> tuple[dict[int, float], float]:
    """One-row steps at growing contexts; the least-squares slope per context token."""
    top = max(PROMPT + 1, min(longest, g.sub.max_seq - repeats - 1))
    points = sorted({PROMPT, max(PROMPT, top // 4), top})
    costs: dict[int, float] = {}
    for n in points:
        seq = SEQ_CONTEXT + n
        took, _ok = run.start(seq, n)
        if took is None:
            continue
        times = [t for t, _ in (run.decode(g, [seq]) for _ in range(repeats))
                 if t is not None]
        if times:
            costs[n + 1] = statistics.median(times)
        run.release(seq)
    if len(costs) < 2:
        return costs, 0.0
    xs, ys = np.array(list(costs), dtype=float), np.array(list(costs.values()))
    slope = float(np.polyfit(xs, ys, 1)[0])
    return costs, max(0.0, slope)


def measure_prefill(run: Run) -> float | None:
    sub = run.prefill.sub
    n1, n2 = 8, max(16, min(256, sub.max_tokens))
    t1, _ = run.start(SEQ_PREFILL, n1)
    t2, _ = run.start(SEQ_PREFILL + 1, n2)
    for s in (SEQ_PREFILL, SEQ_PREFILL + 1):
        run.release(s)
    if t1 is None or t2 is None or n2 <= n1:
        return None
    return max(0.0, (t2 - t1) / (n2 - n1))


def continuity(run: Run, graphs: list[Graph], steps: int) -> dict[str, Any]:
    """``SEQ_MOVE`` decoded on every graph in turn (as the last row beside ``SEQ_STAY``'s
    twin where a graph has two rows or more), ``SEQ_STAY`` the same prompt on the widest
    graph alone: every step's logits compared bit for bit."""
    companion = SEQ_MOVE + 50
    widest = graphs[-1]
    run.start(SEQ_MOVE, PROMPT)
    run.start(SEQ_STAY, PROMPT, like=SEQ_MOVE)
    run.start(companion, PROMPT)
    # the stayer decodes the same tokens as the mover: same prompt, same positions
    moved = differ = 0
    path: list[str] = []
    for i in range(steps):
        g = graphs[i % len(graphs)]
        tok = (i * 31 + 5) % run.vocab
        pos = run.pos[SEQ_MOVE]
        beside = i % 2 == 1 and g.batch >= 2
        rows = ([(companion, [run.token(companion)], run.pos[companion])] if beside else []) \
            + [(SEQ_MOVE, [tok], pos)]
        took, out, what = g.step(rows)
        stay_t, stay_out, stay_what = widest.step([(SEQ_STAY, [tok], pos)])
        path.append(f"{g.sub.exact_name}{' row 1' if beside else ''}")
        if took is None or stay_t is None:
            run.problems.append(f"continuity step {i}: {what} / {stay_what}")
            differ += 1
            continue
        if beside:
            run.right(companion, rows[0][1], rows[0][2], out[0])
            run.pos[companion] += 1
        if not np.array_equal(out[-1], stay_out[0]):
            differ += 1
            run.problems.append(f"continuity step {i} on {g.sub.exact_name}: logits differ "
                                "from the same step on one graph")
        run.right(SEQ_MOVE, [tok], pos, out[-1])
        run.pos[SEQ_MOVE] = run.pos[SEQ_STAY] = pos + 1
        moved += 1
    for s in (SEQ_MOVE, SEQ_STAY, companion):
        run.release(s)
    return {"steps": steps, "moved": moved, "differ": differ, "path": path}


def observe(ctx: RunContext) -> Outcome:
    args = ctx.args
    repeats = max(1, args.repeats)
    decodes = list(ctx.manifest.graphs(TaskKind.DECODE))
    run = Run(ctx)
    graphs = [Graph(ctx.bench, sub) for sub in decodes]
    obs: dict[str, Any] = {"graphs": [g.sub.exact_name for g in graphs],
                           "repeats": repeats}
    records, lines = [], []
    try:
        prefill_s = measure_prefill(run)
        for g in graphs:
            by_rows = measure_rows(run, g, repeats)
            by_context, slope = measure_context(run, g, repeats, args.max_context)
            records.append(graph_cost_record(g.sub, by_rows, context_s_per_token=slope,
                                             context_s=by_context))
            full = by_rows.get(g.batch)
            lines.append(f"- {g.sub.exact_name} (b{g.batch} s{g.sub.max_seq}): "
                         + ", ".join(f"{r} rows {s * 1e3:.3f} ms" for r, s in by_rows.items())
                         + f"; context +{slope * 1e9:.2f} ns/token"
                         + ("" if full is not None else " (the full step failed)"))
        records.append(graph_cost_record(run.prefill.sub, {}, prefill_s_per_token=prefill_s))
        lines.append(f"- prefill {run.prefill.sub.exact_name}: "
                     + (f"{prefill_s * 1e6:.2f} us/token" if prefill_s is not None
                        else "not measured"))
        move = continuity(run, graphs, max(args.move_steps, 2 * len(graphs)))
    finally:
        for g in [*graphs, run.prefill]:
            g.destroy()
    obs["step_costs"] = step_costs_observation(records)
    obs["kv_continuity"] = move
    obs["problems"] = run.problems[:20]
    obs["n_problems"] = len(run.problems)
    measured = all(len(r["decode_s"]) == len(row_counts(r["max_batch"]))
                   for r in records if r["kind"] == TaskKind.DECODE.value)
    cost_ok = measured and not any("continuity" not in p for p in run.problems)
    cost_why = (f"{len(graphs)} decode graph(s) measured, every output right"
                if cost_ok else f"{len(run.problems)} problem(s): "
                + "; ".join(run.problems[:3]))
    moved_ok = move["differ"] == 0 and move["moved"] == move["steps"]
    move_why = (f"{move['moved']} steps over {len(graphs)} graph(s) bit-exact with staying "
                "on one" if moved_ok else
                f"{move['differ']} of {move['steps']} steps differ from staying on one graph")
    verdicts = {"graph_step_costs": Verdict(cost_ok, cost_why),
                "graph_kv_continuity": Verdict(moved_ok, move_why)}
    summary = [*lines, f"- KV continuity: {move_why}"]
    return Outcome(obs, verdicts, summary, complete=measured)


def main(argv: list[str] | None = None, *, driver: Driver | None = None) -> int:
    return run_runner(NAME, __doc__.splitlines()[0], observe, argv, add_arguments,
                      driver=driver, per_calbin=True)


if __name__ == "__main__":
    sys.exit(main())
