"""``calfsm serve`` keeps its deadlines under a load it cannot finish in time (issue 20,
item 2): 64 clients asking for 100 tokens each on a device that runs one step at a time
need more device time than the request timeout allows (at the defaults 64 x 100 x 10 ms
= 64 s > 60 s). Every request either completes with all its tokens or is refused at once
with a 429 and a Retry-After (the library's admission estimate, ``stage == "capacity"``,
answered by the server); none is accepted and then timed out (504), none is a 5xx.

Here the defaults are scaled down two times in time (``--decode-ms 5 --request-timeout
30``: 32 s of work against 30 s). Not further: the host's share of a step does not scale
with the device time, so at 1 ms a step (ten times down) a busy machine's host time was
as large as the device's, the admission estimate (made before any step of the burst was
measured) was off by more than its slack, and the scenario was no longer the defaults'
(it failed one loaded run in five). ``bench/bench_serve_deadlines.py`` runs the real
defaults.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from tests.helpers.serve_load import start_serve

pytestmark = pytest.mark.timeout(90)

CLIENTS, TOKENS = 64, 100


async def one(c: httpx.AsyncClient, i: int, stream: bool) -> dict[str, Any]:
    """One client's request: its status, when the answer began and when it ended (s
    after sending), and how it ended (finish reason, or the error of a stream that
    failed after its first token), with its tokens and Retry-After."""
    t0 = time.monotonic()
    out = await _one(c, i, stream, t0)
    out["took"] = time.monotonic() - t0
    return out


async def _one(c: httpx.AsyncClient, i: int, stream: bool, t0: float) -> dict[str, Any]:
    body = {"model": "qwen3-b1", "prompt": [(i * 7919 + k * 104729) % 151936
                                            for k in range(8)],
            "max_tokens": TOKENS, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        out: dict[str, Any] = {"status": r.status_code, "after": time.monotonic() - t0,
                               "retry_after": r.headers.get("retry-after"),
                               "stream": stream}
        if r.status_code != 200 or not stream:
            out["body"] = json.loads(await r.aread())
            if r.status_code == 200:
                choice = out["body"]["choices"][0]
                out["end"] = choice["finish_reason"]
                out["tokens"] = out["body"]["usage"]["completion_tokens"]
            return out
        events = [json.loads(line[6:]) for line in [ln async for ln in r.aiter_lines()]
                  if line.startswith("data: {")]
    if "error" in events[-1]:                # it failed after its first token
        out["end"] = events[-1]["error"]["code"]
        return out
    out["end"] = events[-2]["choices"][0]["finish_reason"]
    out["tokens"] = events[-1]["usage"]["completion_tokens"]
    return out


def test_64_clients_x_100_tokens_each_complete_or_get_a_429_at_once_never_a_504():
    proc, port = start_serve("--decode-ms", "5", "--request-timeout", "30")

    async def clients() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                     limits=limits) as c:
            return await asyncio.gather(*(one(c, i, i % 2 == 0) for i in range(CLIENTS)))

    try:
        answers = asyncio.run(clients())
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    done = [a for a in answers if a["status"] == 200]
    refused = [a for a in answers if a["status"] == 429]
    print(f"{len(done)} completed, {len(refused)} refused; slowest 429 after "
          f"{max((a['after'] for a in refused), default=0) * 1e3:.0f} ms")
    assert len(done) + len(refused) == CLIENTS, [a for a in answers
                                                 if a["status"] not in (200, 429)]
    assert done and refused, (len(done), len(refused))
    for a in done:                           # every completed one has all its tokens
        assert a["end"] == "length" and a["tokens"] == TOKENS, a
    for a in refused:
        assert a["body"]["error"]["type"] == "rate_limit_error", a
        assert int(a["retry_after"]) >= 1, a
        # refused at once: by the admission estimate, before a job existed (not held in
        # a queue, not timed out), so well before the 30 s a doomed request would have
        # been held. The wall time bound is a sanity check only: how soon the answer
        # leaves depends on how much CPU a busy machine gives the server (2.9 s seen
        # with load 7 on 2 cores); bench/bench_serve_deadlines.py measures the real
        # figure on a quiet machine against the 100 ms
        assert "cannot serve this stream in time" in a["body"]["error"]["message"], a
        assert a["after"] < 10.0, a
    assert "Traceback" not in err, err
