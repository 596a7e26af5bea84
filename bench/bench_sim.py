"""Cost of one simulated decode step at V=151936 (qwen3-b1), virtual-time mode.

Run from the repository root::

    python bench/bench_sim.py            # default 2000 steps
    python bench/bench_sim.py --steps 500
    python bench/bench_sim.py --smoke   # seconds; its figures mean nothing

Reports CPU time per step (``time.process_time``; target <= 2 ms) for

- ``kernel``: the logits of one hash written into a preallocated row (refmodel);
- ``device``: one decode job on SimDriver, ``infer`` + ``wait`` + ``status`` (the device
  side: hash step, logits into the mapped host buffer, job bookkeeping), trace off/on;
- ``direct``: a full ``DirectRunner.decode_bf16`` step (kv_apply, 2x set_csr, set_kv_seq,
  infer, wait, status, output_bytes), trace off;

and tracemalloc figures: bytes still allocated after N steps (growth per step) and the
peak above the baseline within them, to show that a step allocates nothing beyond the
output it writes (the output is the mapped host buffer, allocated once). With the trace
on, each call appends one small record; that is the only growth.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import numpy as np
from runs import add_smoke_option

from calfsm.drivers import refmodel
from calfsm.drivers.sim import SimDriver
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.tools.direct import DirectRunner


def cpu_per_step(fn, steps: int) -> float:
    for i in range(20):
        fn(i)
    gc.collect()
    gc.disable()
    try:
        t0 = time.process_time()
        for i in range(steps):
            fn(i)
        return (time.process_time() - t0) / steps
    finally:
        gc.enable()


def alloc_per_step(fn, steps: int) -> tuple[float, int]:
    for i in range(20):
        fn(i)
    gc.collect()
    tracemalloc.start()
    try:
        fn(0)
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        for i in range(steps):
            fn(i)
        cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return (cur - base) / steps, peak - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    add_smoke_option(ap, "a second, 20 steps each")
    args = ap.parse_args()
    if args.smoke:
        args.steps = 20
    m = builtin_manifest("qwen3-b1")
    vocab = m.submodel(TaskKind.DECODE).vocab
    rows = []

    out = np.empty(vocab, np.uint16)
    k = refmodel.kernel(vocab)
    rows.append(("kernel (logits into a row)", lambda i: k.into(i, out)))

    for trace in (False, True):
        d = SimDriver(m, trace=trace)
        r = DirectRunner(d, m)
        s = r.sets[TaskKind.DECODE]
        s.tok[0] = 1
        s.pos[0] = 0
        r.program(s, 0, 1, 1)   # KV room, both CSRs and the KV sequence, once

        def device(i, d=d, s=s):
            d.infer(s.handle, s.inp, s.out)
            d.wait(s.out, 1.0)
            d.status(s.out)
        rows.append((f"device: infer+wait+status, trace={'on' if trace else 'off'}", device))

    d = SimDriver(m, trace=False)
    r = DirectRunner(d, m)
    r.prefill_bf16(0, [1, 2, 3])
    rows.append(("direct: DirectRunner.decode_bf16", lambda i: r.decode_bf16(0, i & 1023,
                                                                             3 + (i % 4000))))

    print(f"V={vocab}, {args.steps} steps each, virtual clock\n")
    print(f"{'what':48} {'CPU ms/step':>11} {'alloc B/step':>13} {'peak B':>9}")
    for name, fn in rows:
        cpu = cpu_per_step(fn, args.steps)
        per, peak = alloc_per_step(fn, min(args.steps, 500))
        print(f"{name:48} {cpu * 1e3:11.3f} {per:13.1f} {peak:9d}")
    print(f"\noutput row itself: {vocab * 2} B (mapped once, rewritten in place)")


if __name__ == "__main__":
    main()
