"""Continuous batching at Qwen3's vocabulary (V = 151,936): does the host keep up with the
device, and do shape buckets cost a lone stream nothing? (issue 36, must-shows)

Run from the repository root::

    python bench/bench_scale.py                 # three runs, quiet (~6 minutes)
    python bench/bench_scale.py --load 2        # the same beside two busy processes
    python bench/bench_scale.py --quick         # one run, fewer tokens
    python bench/bench_scale.py --smoke         # seconds; its figures mean nothing

The device: SimDriver in real time, a static calbin's cost model
(``LatencyModel.fixed(decode_s=10 ms, batch_row_share=0.05, shape_cost="graph")``): a
decode step on a graph of batch ``b`` costs ``10 ms * (1 + 0.05 * (b - 1))`` whatever
rows it carries, 13.5 ms at b8, 41.5 ms at b64. The manifest: ``qwen3-buckets`` (decode
graphs at batch 1 .. 64) with the step-cost runner's evidence as
``examples/vendor/step_costs.py`` writes it on this device
(:func:`calfsm.testing.batching.write_step_costs`), and the batch runner's proving ``B``
rows, so B rows run on its ``bB`` graph;
``--manifest resized`` runs ``qwen3-b8`` with its batch dimension set to ``B`` instead
(``qwen3-bB``, :func:`manifest`; the issue's first measurement).

For each B in 8, 16, 32, 64 and each sampling (greedy; Qwen3's recommended temperature
0.7, top-p 0.8, top-k 20, seeded), ``2B`` streams at once (so every step is full and the
next rows already wait):

- aggregate tokens/s while every stream runs (from the last first token to the first
  last token), against the device-bound ideal ``B / step(B)`` (targets: >= 0.95x quiet,
  >= 0.90x with ``--load 2``);
- the host's critical tail per row, P50: ``JobTimings.tail_ms`` (from a step's wait
  returning until the next steps were handed to the submitter) over the ``B`` rows
  (targets: <= 40 us greedy, <= 150 us with Qwen3's sampling), and the whole tail
  against the device's step (the physical limit: what is left of the step for the
  host).

Then (``--no-lone``, ``--no-ramp`` to skip):

- a lone greedy stream on ``qwen3-buckets`` (its b1 graph) against ``qwen3-b1``, P50 time
  per token (target <= 1.02x), and against the device's 1-row step;
- a ramp of 1 -> 64 -> 1 greedy streams at once (``--levels``, one level after another
  on one executor): ``qwen3-buckets`` with its step costs, and without them (one graph,
  the widest: the comparison), each level's tokens/s against the best single graph's
  (``best_single``: the batch ``b`` whose ``min(n, b) / step(b)`` is highest, measured
  on its own executor; target >= 0.9x at every level) and the buckets' against the
  device's ideal there.

``--before`` runs each also without the native tail (every row converted and sampled in
Python, one at a time: the reference and the before), side by side; ``--no-tail`` only
without. ``cpu us/row``: the same work alone, this thread's CPU per row (the native tail
on one thread, a stream step's way; before: row by row), which a busy machine moves
less than the wall-clock figures; ``--cpu-only`` measures only that.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cpuload import add_load_option, cpu_load  # noqa: E402
from runs import add_smoke_option, print_summary, repeat  # noqa: E402

from calfsm.clock import RealClock  # noqa: E402
from calfsm.drivers.sim import LatencyModel, SimDriver  # noqa: E402
from calfsm.engine import tail  # noqa: E402
from calfsm.executor import DeviceExecutor, ExecutorConfig  # noqa: E402
from calfsm.generate.sampling import SamplingParams  # noqa: E402
from calfsm.manifest import Manifest, TaskKind, builtin_manifest  # noqa: E402
from calfsm.testing.batching import (  # noqa: E402
    DecodeSteps,
    write_batch_evidence,
    write_step_costs,
)

DECODE_S = 0.010
SHARE = 0.05
BATCHES = (8, 16, 32, 64)
#: the ramp's concurrent streams, one level after another
LEVELS = (1, 2, 4, 8, 16, 32, 64, 32, 16, 8, 4, 2, 1)
SAMPLINGS = {
    "greedy": {},
    "qwen3": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
}
TIMEOUT_S = 900.0


def step_s(rows: int) -> float:
    """The device's step of ``rows`` rows (the latency model's)."""
    return DECODE_S * (1 + SHARE * (rows - 1))


def manifest(batch: int) -> Manifest:
    """``qwen3-b8`` with every graph's batch dimension set to ``batch``."""
    data = copy.deepcopy(builtin_manifest("qwen3-b8").to_dict())
    data["name"] = f"qwen3-b{batch}"
    for sub in data["submodels"]:
        sub["exact_name"] = sub["exact_name"].replace("_b8_", f"_b{batch}_")
        sub["max_batch"] = batch
        for tensor in ("token_or_embed", "position", "logits"):
            t = sub[tensor]
            t["shape"][0] = batch
            t["byte_size"] = t["byte_size"] // 8 * batch
    return Manifest.from_dict(data)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3) % 151_936, (11 * i + 5) % 151_936, (13 * i + 1) % 151_936]
            for i in range(n)]


@contextlib.contextmanager
def executor(m: Manifest, rows: int, costs: bool) -> Iterator[DeviceExecutor]:
    """An executor on ``m`` over the static device (``shape_cost="graph"``) in real time,
    its evidence proving batches of ``rows`` rows and, if ``costs``, the step costs (the
    shape buckets' evidence); ``ex.graph_steps`` counts its decode steps by graph."""
    latency = LatencyModel.fixed(decode_s=DECODE_S, prefill_per_token_s=2e-4,
                                 batch_row_share=SHARE, shape_cost="graph")
    drv = SimDriver(m, clock=RealClock(), latency=latency)
    with tempfile.TemporaryDirectory(prefix="calfsm-bench-scale-") as evidence:
        # the batch runner's and the step-cost runner's evidence on this static device
        # (examples/vendor/batch_semantics.py and step_costs.py write the same files)
        write_batch_evidence(evidence, drv, max_rows=rows)
        if costs:
            write_step_costs(evidence, drv, m, decode_s=DECODE_S, share=SHARE)
        with DeviceExecutor(drv, m, ExecutorConfig(evidence_dir=evidence,
                                                   admission_estimate=False,
                                                   max_waiting=4 * rows + 8,
                                                   admission_timeout_s=600.0,
                                                   queue_timeout_s=600.0,
                                                   default_deadline_s=TIMEOUT_S)) as ex:
            ex.graph_steps = log = DecodeSteps()    # type: ignore[attr-defined]
            ex.add_observer(log)
            yield ex


def streams_at_once(ex: DeviceExecutor, n: int, sampling: str, tokens: int
                    ) -> tuple[float, float]:
    """``n`` streams of ``tokens`` at once: tokens/s while every stream runs (from the
    last first token to the first last token: each stream's rate there, summed) and the
    critical tail's P50 (ms, a step's, over the steps inside that window)."""
    gc.collect()
    gc.disable()
    try:
        streams = [ex.generate(p, SamplingParams(max_tokens=tokens, seed=i,
                                                 **SAMPLINGS[sampling]))
                   for i, p in enumerate(prompts(n))]
        results = [s.result(TIMEOUT_S) for s in streams]
        events = [list(s) for s in streams]
    finally:
        gc.enable()
    times = []
    for s, r in zip(streams, results, strict=True):
        assert len(r.tokens) == tokens, r
        times.append(s.started + r.ttft_s
                     + np.concatenate(([0.0], np.cumsum(r.inter_token_s))))
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    # each stream's rate inside the window (its tokens there, one fewer intervals, over
    # their span), summed: a closed window's count over its span would count a token at
    # each end (1.2x for one stream of 6 tokens)
    rate = 0.0
    for t in times:
        got = t[(t >= start) & (t <= end)]
        if len(got) >= 2:
            rate += (len(got) - 1) / (got[-1] - got[0])
    tails = [e.timings.tail_ms for ev, t in zip(events, times, strict=True)
             for e, at in zip(ev, t, strict=True) if start <= at <= end and e.index > 0]
    return rate, float(np.median(tails)) if tails else float("nan")


def run(m: Manifest, batch: int, sampling: str, tokens: int) -> dict[str, float]:
    """``2 * batch`` streams of ``tokens`` on ``m`` (at most ``batch`` rows a step):
    tokens/s over the ideal, the critical tail."""
    bucketed = len(m.graphs(TaskKind.DECODE)) > 1
    with executor(m, batch, costs=bucketed) as ex:
        assert ex.max_batch == batch, (ex.max_batch, ex.health().notes)
        rate, tail_ms = streams_at_once(ex, 2 * batch, sampling, tokens)
        steps = ex.graph_steps.steps                # type: ignore[attr-defined]
    graph = steps.most_common(1)[0][0]
    assert not bucketed or graph == f"qwen3_bk_decode_b{batch}", steps
    return {"x ideal": rate / (batch / step_s(batch)),
            "tok/s": rate,
            "tail us/row": tail_ms * 1e3 / batch,
            "tail / step": tail_ms * 1e-3 / step_s(batch)}


def lone(tokens: int) -> dict[str, float]:
    """One stream alone, its inter-token P50 on ``qwen3-buckets`` (step-cost evidence:
    the b1 graph) and on ``qwen3-b1``, each against the device's 1-row step."""
    out = {}
    for name in ("qwen3-buckets", "qwen3-b1"):
        m = builtin_manifest(name)
        with executor(m, 64 if name == "qwen3-buckets" else 1,
                      costs=name == "qwen3-buckets") as ex:
            streams_at_once(ex, 1, "greedy", 4)     # warm
            s = ex.generate(prompts(1)[0], SamplingParams(max_tokens=tokens))
            r = s.result(TIMEOUT_S)
        out[name] = float(np.median(r.inter_token_s))
    return {"lone buckets ms/token": out["qwen3-buckets"] * 1e3,
            "lone b1 ms/token": out["qwen3-b1"] * 1e3,
            "lone buckets / b1": out["qwen3-buckets"] / out["qwen3-b1"],
            "lone buckets / device": out["qwen3-buckets"] / step_s(1)}


def best_single(level: int) -> int:
    """The single graph (of the buckets' batch sizes) that serves ``level`` streams
    fastest on the static device: the most of ``min(level, b) / step(b)``."""
    return max((1, 2, 4, 8, 16, 32, 64), key=lambda b: min(level, b) / step_s(b))


def ramp(levels: tuple[int, ...], tokens: int) -> dict[str, float]:
    """``levels[i]`` greedy streams at once, one level after another on one executor:
    on ``qwen3-buckets`` with the step costs (buckets), without them (one graph, the
    widest), and on the best single graph of each level (its own executor); each
    level's tokens/s against the best single graph's and the device's ideal."""
    m = builtin_manifest("qwen3-buckets")
    out: dict[str, float] = {}
    rates: dict[str, list[float]] = {}
    for name, costs in (("buckets", True), ("no evidence", False)):
        with executor(m, max(levels), costs=costs) as ex:
            rates[name] = [streams_at_once(ex, n, "greedy", tokens)[0] for n in levels]
    single: dict[int, float] = {}
    for n in levels:
        if n not in single:
            b = best_single(n)
            with executor(builtin_manifest("qwen3-b1") if b == 1 else manifest(b), b,
                          costs=False) as ex:
                single[n] = streams_at_once(ex, n, "greedy", tokens)[0]
    for i, n in enumerate(levels):
        ideal = min(n, best_single(n)) / step_s(best_single(n))
        tag = f"ramp {i:02d} n={n}"
        out[f"{tag} buckets / single"] = rates["buckets"][i] / single[n]
        out[f"{tag} no-evid / single"] = rates["no evidence"][i] / single[n]
        out[f"{tag} buckets x ideal"] = rates["buckets"][i] / ideal
    out["ramp min buckets / single"] = min(rates["buckets"][i] / single[n]
                                           for i, n in enumerate(levels))
    return out


def tail_cpu(batch: int, sampling: str, native: bool, reps: int) -> float:
    """CPU microseconds per row of the part of a step's tail the next step waits for,
    alone (no executor): ``batch`` rows of the reference model's logits at V=151,936
    converted and sampled, by the native tail on one thread (as a stream step: the token
    only) or row by row in Python (``extract_logits`` then ``Sampler.sample``: before).
    This thread's CPU time, so a busy machine moves it less than the wall time."""
    from calfsm.drivers import refmodel
    from calfsm.engine.logits import extract_logits
    vocab = 151_936
    contract = next(s for s in manifest(1).submodels if s.kind.value == "decode")
    out = np.stack([refmodel.logits_bf16(i * 7919 + 1, vocab) for i in range(batch)])
    dst = [np.empty(vocab, np.float32) for _ in range(batch)]
    samplers = [SamplingParams(seed=i, **SAMPLINGS[sampling]).sampler_for(vocab)
                for i in range(batch)]
    src = tail.output_pointer(out.reshape(-1))
    times = []
    for _ in range(reps + 1):           # the first warms up (imports, plans): not counted
        t0 = time.thread_time_ns()
        if native:
            rows = []
            for i, s in enumerate(samplers):
                row = s.tail_row()
                row.bind(src + i * vocab, None)
                rows.append(row)
            tail.run_tail(rows, 1)
            for s, row in zip(samplers, rows, strict=True):
                s.tail_token(row)
        else:
            for i, s in enumerate(samplers):
                s.sample(extract_logits(out[i], contract.logits.byte_size, contract, 1,
                                        dst[i]))
        times.append(time.thread_time_ns() - t0)
    return float(np.median(times[1:])) / 1e3 / batch


def one_run(args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    for batch in args.batches:
        for sampling in SAMPLINGS:
            if args.tail:
                out[f"B{batch} {sampling} cpu us/row"] = tail_cpu(batch, sampling, True,
                                                                 args.reps)
            if args.before:
                out[f"B{batch} {sampling} cpu us/row before"] = tail_cpu(
                    batch, sampling, False, args.reps)
            if args.cpu_only:
                continue
            variants = [True] if args.tail else []
            variants += [False] if args.before else []
            for native in variants:
                tail.use_native_tail(None if native else False)
                m = builtin_manifest("qwen3-buckets") if args.manifest == "qwen3-buckets" \
                    else manifest(batch)
                r = run(m, batch, sampling, args.tokens)
                for k, v in r.items():
                    out[f"B{batch} {sampling} {k}{'' if native else ' before'}"] = v
            tail.use_native_tail(None if args.tail else False)
    if args.cpu_only:
        return out
    if args.lone:
        out.update(lone(args.tokens * 2))
    if args.ramp:
        out.update(ramp(args.levels, args.tokens))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=40, help="tokens per stream")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")],
                   default=list(BATCHES), help="comma-separated B (default 8,16,32,64)")
    p.add_argument("--quick", action="store_true", help="one run, 20 tokens")
    p.add_argument("--no-tail", dest="tail", action="store_false",
                   help="without the native tail (rows one by one in Python)")
    p.add_argument("--before", action="store_true",
                   help="also without the native tail, side by side (figures '... before')")
    p.add_argument("--cpu-only", action="store_true",
                   help="only the tail's CPU per row, no streams")
    p.add_argument("--reps", type=int, default=15, help="repetitions of the CPU figure")
    p.add_argument("--threads", type=int, default=None,
                   help="native tail threads (default: the cores, at most 4)")
    p.add_argument("--manifest", choices=("qwen3-buckets", "resized"),
                   default="qwen3-buckets",
                   help="qwen3-buckets (default, with its step-cost evidence: B rows run on "
                        "its bB graph) or resized (qwen3-b8 with its batch set to B)")
    p.add_argument("--no-lone", dest="lone", action="store_false",
                   help="skip the lone stream on qwen3-buckets against qwen3-b1")
    p.add_argument("--no-ramp", dest="ramp", action="store_false",
                   help="skip the ramp of 1 -> 64 -> 1 streams")
    p.add_argument("--levels", type=lambda s: tuple(int(b) for b in s.split(",")),
                   default=LEVELS, help="the ramp's levels (default 1,2,..,64,..,2,1)")
    add_load_option(p)
    add_smoke_option(p, "a few seconds, one run at B=8 of 6 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.tokens = 1, 20
    if args.smoke:
        args.runs, args.tokens, args.batches, args.reps = 1, 6, [8], 2
        args.levels = (1, 4, 1)
        args.before = True
    tail.use_native_tail(None if args.tail else False)
    threads = tail.set_threads(args.threads)
    with cpu_load(args.load):
        runs = repeat(args.runs, lambda _: one_run(args))
    print(f"\nqwen3 (V=151,936), decode {DECODE_S * 1e3:.0f} ms, batch_row_share {SHARE}, "
          f"2B streams x {args.tokens} tokens, load {args.load}, native tail "
          f"{'on, ' + str(threads) + ' threads' if tail.native_tail_available() else 'off'}")
    for b in args.batches:
        print(f"  B={b}: step {step_s(b) * 1e3:.1f} ms, ideal {b / step_s(b):.0f} tok/s, "
              f"{step_s(b) / b * 1e6:.0f} us of step per row")
    print_summary(runs, width=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
