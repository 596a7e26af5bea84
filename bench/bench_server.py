"""The reference server against the executor's own streams, on the real-time simulated
device: time per output token at 1, 8 and 32 streaming clients.

Run from the repository root::

    python bench/bench_server.py                    # ~4 min: 1, 8, 32 clients, 3 rounds
    python bench/bench_server.py --quick            # ~30 s: 1 and 8 clients, 2 rounds
    python bench/bench_server.py --clients 1 --rounds 5
    python bench/bench_server.py --smoke   # seconds; its figures mean nothing

Two paths, each with its own executor on its own ``realtime_sim(manifest, decode_ms)``
(qwen3-b1, V=151936, 10 ms per decode, prefill 50 us per token, greedy):

- **streams**: N streams at once on an executor in this process, each consumed with
  ``async for`` on one event loop; a token's time is when its event reaches the loop;
- **server**: ``calfsm serve`` in a subprocess (uvicorn, same manifest and latency), N
  httpx clients streaming ``/v1/completions`` at once from this process; a token's
  time is when its SSE line reaches the client. Each client's text is checked to
  decode to the same tokens as the streams path gave.

Aggregate tokens/s is every client's tokens over the round's wall time (prefills
included), the figure to set beside a batch manifest's cost model (``--manifest tiny-b8
--batch-row-share 0.05 --clients 64``, and the same on ``tiny``).

Time per output token (TPOT) is the gap between two consecutive tokens of one client,
pooled over the clients (an SSE chunk that holds two tokens — a byte the text decoder
held until the next token completed it — counts as two tokens at half its gap); P50 and
P99 per path, and the server's over the streams'. The
paths run interleaved (streams, server, server, streams, ...) so drift hits both; each
figure is shown as its range over the rounds. The server's own overhead is its P50 over
the streams' minus 1 at one client; the target (issue 15) is <= 3%.

The device is one (max in flight 1), so N clients share it: their TPOT is about N
decodes; the ratio is what the HTTP layer adds on top of the library.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runs import add_smoke_option

from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.serve import ByteTokenizer, realtime_sim

MANIFEST = "qwen3-b1"
#: the model name the server answers to (the manifest's; --manifest changes it)
MODEL = [MANIFEST]
VOCAB = [151936]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _prompt(i: int) -> list[int]:
    return [(i * 7919 + k * 104729) % VOCAB[0] for k in range(8)]


async def streams_round(ex: DeviceExecutor, clients: int, tokens: int
                        ) -> tuple[list[float], dict[int, list[int]]]:
    params = SamplingParams(max_tokens=tokens)

    async def one(i: int) -> tuple[list[float], list[int]]:
        stream = ex.generate(_prompt(i), params)
        times, toks = [], []
        async for ev in stream:
            times.append(time.perf_counter())
            toks.append(ev.token)
        return times, toks

    out = await asyncio.gather(*(one(i) for i in range(clients)))
    gaps = [b - a for times, _ in out for a, b in itertools.pairwise(times)]
    return gaps, {i: toks for i, (_, toks) in enumerate(out)}


async def server_round(url: str, clients: int, tokens: int, tok: ByteTokenizer
                       ) -> tuple[list[float], dict[int, list[int]]]:
    import json
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)

    async def one(c: httpx.AsyncClient, i: int) -> tuple[list[float], list[int]]:
        body = {"model": MODEL[0], "prompt": _prompt(i), "max_tokens": tokens,
                "temperature": 0, "stream": True}
        times, text = [], []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    piece = json.loads(line[6:])["choices"][0]["text"]
                    if piece:
                        times.append((now, len(tok.encode(piece))))
                        text.append(piece)
        return times, tok.encode("".join(text))

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        out = await asyncio.gather(*(one(c, i) for i in range(clients)))
    # a chunk holds one token, or two when the first was a byte that may begin a UTF-8
    # character (held until the next token): its gap counts once per token it holds
    gaps = [(b - a) / k for times, _ in out
            for (a, _), (b, k) in itertools.pairwise(times) for _ in range(k)]
    return gaps, {i: toks for i, (_, toks) in enumerate(out)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(decode_ms: float, max_sequences: int, *, manifest: str = "qwen3-b1",
                 share: float = 0.0, evidence: str | None = None
                 ) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    extra = ["--batch-row-share", str(share)] if share else []
    if evidence is not None:
        extra += ["--evidence-dir", evidence]
    proc = subprocess.Popen(
        [sys.executable, "-m", "calfsm.tools.cli", "serve", "--manifest", manifest, "--port",
         str(port), "--decode-ms", str(decode_ms), "--max-sequences", str(max_sequences),
         *extra,
         # every client is 127.0.0.1, one client to the server: lift its per-client limits
         "--max-client-streams", str(max_sequences), "--max-client-waiting",
         str(max_sequences), "--request-timeout", "600"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            if proc.poll() is not None:
                raise SystemExit("calfsm serve exited") from None
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("calfsm serve never became ready")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,8,32", help="client counts, comma-separated")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per client")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per client count")
    ap.add_argument("--decode-ms", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="1 and 8 clients, 2 rounds")
    ap.add_argument("--manifest", default=MANIFEST,
                    help="a built-in manifest; a batch one (tiny-b8, qwen3-b8) batches on "
                         "the batch runner's evidence, written first into a temporary "
                         "directory both paths read")
    ap.add_argument("--batch-row-share", type=float, default=0.0,
                    help="what each row past the first adds to a batch decode step")
    add_smoke_option(ap, "a few seconds: 1 and 2 clients, 2 rounds of 8 tokens on tiny at 2 ms"
                         " a decode, the tokens checked to agree")
    args = ap.parse_args()
    counts = [1, 8] if args.quick else [int(x) for x in args.clients.split(",")]
    rounds = 2 if args.quick else args.rounds
    if args.smoke:
        counts, rounds, args.tokens, args.decode_ms = [1, 2], 2, 8, 2.0
        if args.manifest == MANIFEST:
            args.manifest = "tiny"
    manifest = builtin_manifest(args.manifest)
    MODEL[0] = manifest.name
    VOCAB[0] = manifest.submodel(TaskKind.DECODE).vocab
    evidence = None
    if manifest.submodel(TaskKind.DECODE).batched:
        evidence = tempfile.mkdtemp(prefix="calfsm-bench-evidence-")
        subprocess.run([sys.executable, "examples/vendor/batch_semantics.py", "--manifest",
                        args.manifest, "--out", evidence], check=True,
                       capture_output=True, timeout=300)
    tok = ByteTokenizer(manifest.submodel(TaskKind.DECODE).vocab)
    ex = DeviceExecutor(realtime_sim(manifest, decode_ms=args.decode_ms,
                                     batch_row_share=args.batch_row_share), manifest,
                        ExecutorConfig(max_sequences=max(counts) + 4,
                                       max_waiting=2 * max(counts) + 8,
                                       evidence_dir=evidence))
    proc, url = start_server(args.decode_ms, max(counts) + 4, manifest=args.manifest,
                             share=args.batch_row_share, evidence=evidence)
    print(f"bench_server: {manifest.name}, {args.decode_ms:g} ms per decode, "
          f"{args.tokens} tokens per client, {rounds} rounds, rows per step "
          f"{ex.max_batch}, pid {os.getpid()}; server {url}")
    rows = []
    try:
        for n in counts:
            res: dict[str, list[tuple[float, float, float]]] = {"streams": [], "server": []}
            for r in range(rounds):
                order = ("streams", "server") if r % 2 == 0 else ("server", "streams")
                got = {}
                for path in order:
                    t0 = time.perf_counter()
                    if path == "streams":
                        gaps, toks = asyncio.run(streams_round(ex, n, args.tokens))
                    else:
                        gaps, toks = asyncio.run(server_round(url, n, args.tokens, tok))
                    rate = sum(map(len, toks.values())) / (time.perf_counter() - t0)
                    got[path] = toks
                    res[path].append((_pct(gaps, 0.5), _pct(gaps, 0.99), rate))
                if got["streams"] != got["server"]:
                    raise SystemExit(f"{n} clients: the server's tokens differ")
            rows.append((n, res))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        ex.close()

    def rng(xs: list[float], scale: float = 1e3, fmt: str = "{:.3f}") -> str:
        lo, hi = min(xs) * scale, max(xs) * scale
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"

    print(f"\n{'clients':>7} | {'streams P50 / P99 ms':>24} | {'server P50 / P99 ms':>24} | "
          f"{'server/streams P50':>18} | {'P99':>13} | {'tokens/s streams / server':>25}")
    verdict = None
    for n, res in rows:
        s50 = [a for a, _, _ in res["streams"]]
        s99 = [b for _, b, _ in res["streams"]]
        v50 = [a for a, _, _ in res["server"]]
        v99 = [b for _, b, _ in res["server"]]
        r50 = [v / s for v, s in zip(v50, s50)]
        r99 = [v / s for v, s in zip(v99, s99)]
        rates = [rng([c for _, _, c in res[p]], 1, "{:.0f}") for p in ("streams", "server")]
        print(f"{n:>7} | {rng(s50) + ' / ' + rng(s99):>24} | "
              f"{rng(v50) + ' / ' + rng(v99):>24} | {rng(r50, 1, '{:.4f}'):>18} | "
              f"{rng(r99, 1, '{:.4f}'):>13} | {' / '.join(rates):>25}")
        if n == 1:
            verdict = max(r50)
    if verdict is not None:
        print(f"\nserver overhead at one client, P50: {(verdict - 1) * 100:+.2f}% "
              f"(worst round; target <= 3%): {'PASS' if verdict <= 1.03 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
