"""Constrained decoding's cost at V = 151,936 (qwen3-b8, the realistic tokenizer).

Run from the repository root::

    python bench/bench_constraint.py              # three runs, ~3 minutes
    python bench/bench_constraint.py --load 2     # the same beside 2 busy processes
    python bench/bench_constraint.py --smoke      # seconds; its figures mean nothing

Each run, side by side:

(a) **mask cost per row-step**: a stream's matcher (:class:`RowConstraint`) driven over
    generated JSON schemas (tests/helpers/schemas.py) by noise logits, as the simulated
    device gives them: ``on path`` is what the token path pays (take the plan, mask the
    row: targets P50 <= 50 us, P99 <= 300 us); ``off path`` is the plan made while the
    device runs the step (the matcher's consume and bitmask, and the plan of it);
(b) **schema to first mask**: a schema never seen, compiled (grammar, matcher, first
    mask and plan) with the tokenizer already read: P50 and P95 (target P95 <= 20 ms);
    and a cache hit (the same schema again);
(c) **time per output token at batch 8**: eight greedy streams on qwen3-b8 over a
    real-time simulated device (10 ms a decode step, +5% a row; batched, from the batch
    runner's evidence), with a schema and without: the median gap between a stream's
    tokens while all eight run, and the ratio (target <= 1.05x: the mask hidden behind
    the step).

Every constrained output is checked (it parses and validates) before it is timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cpuload import add_load_option, cpu_load  # noqa: E402
from runs import add_smoke_option, print_summary, repeat  # noqa: E402

from calfsm.clock import RealClock  # noqa: E402
from calfsm.drivers.sim import LatencyModel, SimDriver  # noqa: E402
from calfsm.executor import DeviceExecutor, ExecutorConfig  # noqa: E402
from calfsm.generate.constraint import JsonSchema, compile_constraint, ll_tokenizer  # noqa: E402
from calfsm.generate.sampling import SamplingParams  # noqa: E402
from calfsm.generate.tokenizer import HFTokenizer  # noqa: E402
from calfsm.manifest import builtin_manifest  # noqa: E402
from calfsm.tools.make_tokenizer import cached_tokenizer  # noqa: E402
from tests.helpers.schemas import schemas  # noqa: E402

MANIFEST = "qwen3-b8"
VOCAB = 151_936
LATENCY = LatencyModel.fixed(decode_s=0.010, prefill_per_token_s=5e-5, batch_row_share=0.05)


def mask_cost(tok: HFTokenizer, n_schemas: int, seed: int) -> dict[str, float]:
    """(a): per row-step, on the path and off it, over ``n_schemas`` schemas."""
    rng = np.random.default_rng(seed)
    on, off = [], []
    row = np.empty(VOCAB, np.float32)
    for s in schemas(n_schemas, start=seed * 1000):
        con = compile_constraint(JsonSchema(s), tok, VOCAB).start()
        tokens: list[int] = []
        for _ in range(400):
            t0 = time.perf_counter()
            con.prepare(tokens, 0)
            t1 = time.perf_counter()
            row[:] = rng.standard_normal(VOCAB, dtype=np.float32)
            t2 = time.perf_counter()
            plan = con.plan(tokens, 0)
            if plan.kind == "end":
                break
            con.apply(row, plan)
            t3 = time.perf_counter()
            off.append(t1 - t0)
            on.append(t3 - t2)
            tokens.append(int(row.argmax()))
        else:
            raise AssertionError("a schema did not end in 400 tokens")
        json.loads(tok.decode(tokens))
    on_us, off_us = np.array(on) * 1e6, np.array(off) * 1e6
    return {"on path P50 us": float(np.percentile(on_us, 50)),
            "on path P99 us": float(np.percentile(on_us, 99)),
            "off path P50 us": float(np.percentile(off_us, 50)),
            "off path P99 us": float(np.percentile(off_us, 99)),
            "row-steps": float(len(on))}


def first_mask(tok: HFTokenizer, n: int, seed: int) -> dict[str, float]:
    """(b): schemas never compiled before (a fresh seed range per run), then one again."""
    cold = []
    fresh = schemas(n, start=100_000 + seed * 1000)
    for s in fresh:
        s = {**s, "description": f"run {seed} at {time.time_ns()}"}   # never a cache hit
        t0 = time.perf_counter()
        compile_constraint(JsonSchema(s), tok, VOCAB).start()
        cold.append(time.perf_counter() - t0)
    compile_constraint(JsonSchema(fresh[0]), tok, VOCAB)
    t0 = time.perf_counter()
    for _ in range(10):
        compile_constraint(JsonSchema(fresh[0]), tok, VOCAB).start()
    hit = (time.perf_counter() - t0) / 10
    ms = np.array(cold) * 1e3
    return {"first mask P50 ms": float(np.percentile(ms, 50)),
            "first mask P95 ms": float(np.percentile(ms, 95)),
            "cache hit ms": hit * 1e3}


def write_evidence(directory: str) -> None:
    """The batch runner on the simulated device: the evidence the executor batches by."""
    cmd = [sys.executable, str(ROOT / "examples/vendor/batch_semantics.py"), "--driver",
           "sim", "--manifest", MANIFEST, "--out", directory]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"batch runner failed:\n{done.stdout}\n{done.stderr}")


def _records(schema: dict) -> dict:
    """A list of six of ``schema``'s values (its ``$defs`` kept at the top)."""
    defs = schema.pop("$defs", None)
    out = {"type": "array", "items": schema, "minItems": 6, "maxItems": 6}
    return out if defs is None else {**out, "$defs": defs}


def tpot(tok: HFTokenizer, evidence: str, tokens: int, constrained: bool,
         smoke: bool = False) -> float:
    """(c): eight greedy streams at once (each schema a list of six records, so the
    outputs run long); the median gap between a stream's tokens while all eight run
    (from the last first token to the first last one: a full batch throughout)."""
    m = builtin_manifest(MANIFEST)
    drv = SimDriver(m, clock=RealClock(), latency=LATENCY, trace=False)
    sch = [_records(s) for s in schemas(8, start=500)]
    with DeviceExecutor(drv, m, ExecutorConfig(evidence_dir=evidence,
                                               admission_estimate=False),
                        tokenizer=tok) as ex:
        gc.collect()
        gc.disable()
        try:
            streams = [ex.generate(f"Answer in JSON ({i}).", SamplingParams(
                max_tokens=1000 if constrained and not smoke else tokens, ignore_eos=True,
                constraint=JsonSchema(s) if constrained else None))
                for i, s in enumerate(sch)]
            results = [s.result(600) for s in streams]
        finally:
            gc.enable()
    times = []
    for st, r, s in zip(streams, results, sch, strict=True):
        if constrained and r.finish_reason.value == "stop":
            import jsonschema
            jsonschema.validate(json.loads(r.text), s)
        elif constrained:           # only a smoke run's few tokens may cut one short
            assert r.finish_reason.value == "length" and smoke, r.text
        times.append(st.started + r.ttft_s + np.concatenate(([0.0],
                                                            np.cumsum(r.inter_token_s))))
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    gaps = np.concatenate([np.diff(t[(t >= start) & (t <= end)]) for t in times])
    return float(np.median(gaps)) if gaps.size else float("nan")


def one_run(args: argparse.Namespace, tok: HFTokenizer, evidence: str, i: int
            ) -> dict[str, float]:
    out = mask_cost(tok, args.schemas, i)
    out.update(first_mask(tok, args.schemas, i))
    plain = tpot(tok, evidence, args.tokens, False, args.smoke)
    con = tpot(tok, evidence, args.tokens, True, args.smoke)
    out.update({"TPOT plain ms": plain * 1e3, "TPOT schema ms": con * 1e3,
                "TPOT ratio": con / plain})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--schemas", type=int, default=40, help="schemas per figure")
    p.add_argument("--tokens", type=int, default=60,
                   help="max tokens per stream in (c); a schema ends its stream sooner")
    add_load_option(p)
    add_smoke_option(p, "a few seconds, one run of 2 schemas and 8 streams x 8 tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.schemas, args.tokens = 1, 2, 8
    tok = HFTokenizer.from_dir(cached_tokenizer())
    t0 = time.perf_counter()
    ll_tokenizer(tok, VOCAB)
    print(f"the tokenizer read by llguidance once: {time.perf_counter() - t0:.2f} s")
    with tempfile.TemporaryDirectory(prefix="calfsm-bench-evidence-") as evidence:
        if not args.smoke:          # the smoke runs one row a step: no batch runner
            write_evidence(evidence)
        with cpu_load(args.load):
            runs = repeat(args.runs, lambda i: one_run(args, tok, evidence, i))
    print(f"{args.runs} run(s), --load {args.load}:")
    print_summary(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
