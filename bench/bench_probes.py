"""How fast ``/health`` and ``/ready`` answer while ``calfsm serve`` is saturated by
streaming clients, side by side with the same server idle.

Run from the repository root::

    python bench/bench_probes.py                # ~6 min: idle, 64/128/256/512 clients, 3 rounds
    python bench/bench_probes.py --quick        # ~1 min: idle and 512 clients, 2 rounds
    python bench/bench_probes.py --serve-args="--request-timeout 600"   # sequence-bound
    python bench/bench_probes.py --retry-ms 0   # clients that never back off
    python bench/bench_probes.py --smoke   # seconds; its figures mean nothing

The server is ``calfsm serve`` (its defaults: qwen3-b1 on the simulated device in real
time, 10 ms per decode, 64 sequences, 60 s request timeout; ``--serve-args`` adds
options) in a subprocess on 127.0.0.1. The clients (``tests/helpers/serve_load.py``) run in a
second subprocess, so their work never delays the prober: each of N clients loops over
streaming ``POST /v1/completions`` (8 prompt tokens, ``--tokens`` of output) on a fresh
connection each time, reading each answer to its end; after a 429 or 503 it pauses for
the answer's ``retry-after-ms`` (what the official OpenAI client honours), or for
``--retry-ms``. With the defaults most clients are turned away by the admission estimate
(a 429 whose Retry-After says when the first running stream should end); with
``--request-timeout 600`` by the 64 sequences, i.e. by the server's bound on generation
requests at once (a 429 its front answers without reading the request).

The prober, a thread of this process, asks ``GET /health`` and ``GET /ready`` in turn
every 50 ms on a fresh connection each (as the kubelet does) and times each answer from
connect to its last byte. Each round measures the idle server, then each client count
(``--seconds`` each, after ``--warm`` seconds of load); P50 and P99 per row are shown as
their range over the rounds, with the probes' statuses and the clients' answers by
status. The target (issue 20) is P99 < 100 ms at 512 clients.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runs import add_smoke_option

from tests.helpers.serve_load import Prober, answers, pct, start_load, start_serve


def measure(prober: Prober, port: int, clients: int, args: argparse.Namespace
            ) -> tuple[dict[str, list[float]], Counter, Counter]:
    """One row: the probes' times and statuses with ``clients`` clients (0: idle), and
    the clients' answers by status."""
    load = None
    if clients:
        load = start_load(port, clients, args.warm + args.seconds, tokens=args.tokens,
                          retry_ms=args.retry_ms)
        time.sleep(args.warm)
    prober.take()
    prober.recording.set()
    time.sleep(args.seconds)
    prober.recording.clear()
    times, statuses = prober.take()
    got = answers(load, args.seconds + 120) if load is not None else Counter()
    return times, statuses, got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="64,128,256,512", help="client counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0, help="probing per row")
    ap.add_argument("--warm", type=float, default=3.0, help="load before probing")
    ap.add_argument("--tokens", default="100",
                    help="max_tokens per request: N, or LOW:HIGH for a spread")
    ap.add_argument("--retry-ms", type=float, default=None,
                    help="pause after a 429/503 (default: its retry-after-ms)")
    ap.add_argument("--quick", action="store_true", help="idle and 512 clients, 2 rounds")
    ap.add_argument("--serve-args", default="", help="extra calfsm serve options")
    add_smoke_option(ap, "a few seconds: idle and 8 clients, one round of 1 s each")
    args = ap.parse_args()
    counts = [512] if args.quick else [int(x) for x in args.clients.split(",")]
    rounds = 2 if args.quick else args.rounds
    if args.smoke:
        counts, rounds, args.seconds, args.warm, args.tokens = [8], 1, 1.0, 0.5, "10"
    proc, port = start_serve(*args.serve_args.split())
    prober = Prober(port)
    prober.start()
    backoff = "by retry-after-ms" if args.retry_ms is None else f"{args.retry_ms:g} ms"
    print(f"bench_probes: calfsm serve {args.serve_args or '(defaults)'} on port {port}; "
          f"max_tokens {args.tokens}, {args.seconds:g} s per row, {rounds} rounds, "
          f"clients back off {backoff}; pid {os.getpid()}", flush=True)
    rows: dict[int, list[tuple[dict[str, list[float]], Counter, Counter]]] = {}
    try:
        for r in range(rounds):
            for n in [0, *counts]:
                got = measure(prober, port, n, args)
                rows.setdefault(n, []).append(got)
                t, _, seen = got
                print(f"  round {r + 1} {n:>4} clients: /health P99 "
                      f"{pct(t['/health'], .99) * 1e3:.1f} ms, /ready P99 "
                      f"{pct(t['/ready'], .99) * 1e3:.1f} ms; clients "
                      f"{dict(sorted(seen.items()))}", flush=True)
    finally:
        prober.stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        prober.join(5)

    def rng(xs: list[float]) -> str:
        lo, hi = f"{min(xs) * 1e3:.1f}", f"{max(xs) * 1e3:.1f}"
        return lo if lo == hi else f"{lo}-{hi}"

    print(f"\n{'clients':>7} | {'/health P50 ms':>14} | {'/health P99 ms':>14} | "
          f"{'/ready P50 ms':>13} | {'/ready P99 ms':>13} | {'max ms':>7} | probes "
          "by status | client answers (all rounds)")
    worst99 = 0.0
    for n, got in rows.items():
        cells = []
        for path in ("/health", "/ready"):
            cells += [rng([pct(t[path], .5) for t, _, _ in got]),
                      rng([pct(t[path], .99) for t, _, _ in got])]
        top = max(max(t[p]) for t, _, _ in got for p in t if t[p]) * 1e3
        probes: Counter = sum((s for _, s, _ in got), Counter())
        seen: Counter = sum((a for _, _, a in got), Counter())
        shown = ", ".join(f"{p}={st}:{c}" for (p, st), c in sorted(probes.items()))
        print(f"{n if n else 'idle':>7} | {cells[0]:>14} | {cells[1]:>14} | {cells[2]:>13} "
              f"| {cells[3]:>13} | {top:>7.1f} | {shown} | {dict(sorted(seen.items()))}")
        if n == max(counts):
            worst99 = max(pct(t[p], .99) for t, _, _ in got for p in t)
    print(f"\nworst probe P99 at {max(counts)} clients: {worst99 * 1e3:.1f} ms (target "
          f"< 100 ms): {'PASS' if worst99 < 0.1 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
