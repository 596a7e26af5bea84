"""``calfsm serve`` at its defaults under more work than its request timeout allows: 64
clients asking for 100 tokens each at once (64 x 100 x 10 ms = 64 s of device work
against a 60 s request timeout). Every request must either complete with all its tokens
or be refused at once with a 429 and a Retry-After (issue 20: within 100 ms); none may
be accepted and then time out (504), none may be a 5xx.

Run from the repository root (about 50 s a round at the defaults)::

    python bench/bench_serve_deadlines.py
    python bench/bench_serve_deadlines.py --rounds 3 \\
        --serve-args="--decode-ms 1 --request-timeout 6"
    python bench/bench_serve_deadlines.py --smoke   # seconds; its figures mean nothing

Each round starts a fresh ``calfsm serve`` (qwen3-b1 on the simulated device in real
time, 10 ms per decode, 64 sequences, 60 s request timeout, unless ``--serve-args``
says otherwise), opens 64 connections, then sends the 64 requests at once (half
streaming, ``connection: close``) on raw sockets, so what is timed is the server, not an
HTTP client library: from sending a request to its status line, and to its last byte.
It reports how many completed with all their tokens, how many were refused and how
fast, anything else by status, and the last completion. The same run, scaled down ten
times in time, is a test: ``tests/serve/test_serve_deadlines.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runs import add_smoke_option

from tests.helpers.serve_load import pct, start_serve

CLIENTS, TOKENS = 64, 100
#: --smoke: 8 clients x 10 tokens against 4 sequences at 2 ms a decode
SMOKE = (8, 10, "--max-sequences 4 --decode-ms 2")


def _request(i: int) -> bytes:
    body = {"model": "qwen3-b1", "prompt": [(i * 7919 + k * 104729) % 151936
                                            for k in range(8)],
            "max_tokens": TOKENS, "temperature": 0, "stream": i % 2 == 0}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
            f"application/json\r\ncontent-length: {len(data)}\r\nconnection: close"
            "\r\n\r\n").encode() + data


def _outcome(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """What a client got: 'length' with its tokens, a 429 with its Retry-After, or what
    else (the status, or the error code a stream ended with)."""
    if status != 200:
        return {"status": status, "retry_after": headers.get("retry-after")}
    text = body.decode()
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        if "error" in events[-1]:
            return {"status": f"200 then {events[-1]['error']['code']}"}
        return {"status": 200, "end": events[-2]["choices"][0]["finish_reason"],
                "tokens": events[-1]["usage"]["completion_tokens"]}
    out = json.loads(text)
    return {"status": 200, "end": out["choices"][0]["finish_reason"],
            "tokens": out["usage"]["completion_tokens"]}


async def _round(port: int) -> list[dict[str, Any]]:
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CLIENTS)]
    reqs = [_request(i) for i in range(CLIENTS)]

    async def one(i: int) -> dict[str, Any]:
        reader, writer = conns[i]
        t0 = time.perf_counter()
        writer.write(reqs[i])
        status = int((await reader.readline()).split()[1])
        answered = time.perf_counter() - t0
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.read()                     # to its end: connection: close
        writer.close()
        return _outcome(status, headers, body) | {"answered": answered,
                                                  "took": time.perf_counter() - t0}

    return await asyncio.gather(*(one(i) for i in range(CLIENTS)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--serve-args", default="", help="extra calfsm serve options")
    add_smoke_option(ap, "a few seconds, one round of 8 clients x 10 tokens on 4 sequences")
    args = ap.parse_args()
    if args.smoke:
        global CLIENTS, TOKENS
        CLIENTS, TOKENS, args.serve_args = SMOKE
        args.rounds = 1
    print(f"bench_serve_deadlines: {CLIENTS} clients x {TOKENS} tokens at once against "
          f"calfsm serve {args.serve_args or '(defaults)'}, {args.rounds} round(s)")
    verdict = True
    for r in range(args.rounds):
        proc, port = start_serve(*args.serve_args.split())
        try:
            answers = asyncio.run(_round(port))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        full = [a for a in answers if a["status"] == 200 and a["end"] == "length"
                and a["tokens"] == TOKENS]
        refused = [a["answered"] for a in answers if a["status"] == 429
                   and a["retry_after"] is not None]
        other = Counter(str(a["status"]) for a in answers
                        if a not in full and not (a["status"] == 429 and a["retry_after"]))
        ok = len(full) + len(refused) == CLIENTS and max(refused, default=0) < 0.1
        verdict &= ok
        print(f"  round {r + 1}: {len(full)} completed with {TOKENS} tokens (the last "
              f"after {max((a['took'] for a in full), default=0):.2f} s), {len(refused)} "
              f"refused with 429 + Retry-After (P50 {pct(refused, .5) * 1e3:.1f} ms, max "
              f"{max(refused, default=0) * 1e3:.1f} ms after sending), other: "
              f"{dict(other) or 'none'}{'' if ok else '  <- MISS'}", flush=True)
    print(f"\nevery request completed or was refused within 100 ms, none a 504 or 5xx: "
          f"{'PASS' if verdict else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
