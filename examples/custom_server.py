"""A custom HTTP server over calfsm in well under 200 lines (docs/embedding.md).

What an embedder reaches for, each one library call: request ids and abort by id
(``X-Request-Id``, ``executor.abort``, ``executor.requests``), text in and out through
a tokenizer with stop strings, logprobs, ``n`` choices, priority, and the prompt cache
that makes a chat's next turn cheap. ``POST /generate`` streams one JSON line per token
(``{"index", "text", "logprob"}``) and ends each choice with ``{"index", "finish"}``;
``GET /requests`` lists the live requests; ``DELETE /requests/{id}`` aborts one. A
client that leaves aborts its request.

``python examples/custom_server.py`` serves on a free port of 127.0.0.1, runs its own
client against it (a two-turn chat, a stop string, two choices with logprobs, an abort)
and stops.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from calfsm import DeviceExecutor, ExecutorConfig, SamplingParams, TaskKind, builtin_manifest
from calfsm.errors import CalfsmError
from calfsm.generate.promptcache import PromptCacheConfig
from calfsm.generate.tokenizer import ByteTokenizer
from calfsm.serve import realtime_sim

MANIFEST = builtin_manifest("tiny")


def build_app(executor: DeviceExecutor) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        try:
            params = SamplingParams(
                max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 0),
                seed=body.get("seed"), stop=tuple(body.get("stop", ())),
                logprobs=body.get("logprobs"))
            streams = executor.generate(
                body["prompt"], params, n=body.get("n", 1), priority=body.get("priority", 0),
                request_id=request.headers.get("x-request-id"))
        except CalfsmError as e:          # bad input 400, no room 429 (Retry-After), ...
            return JSONResponse({"error": e.message}, e.http_status)
        rid = streams[0].parent_id                           # the id of the n streams

        async def lines():
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int) -> None:
                async for ev in streams[i]:
                    await queue.put({"index": i, "text": ev.text, "logprob": ev.logprob})
                result = await streams[i].final()
                await queue.put({"index": i, "finish": result.finish_reason.value})

            tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
            try:
                for _ in range(len(streams)):
                    while "finish" not in (item := await queue.get()):
                        yield json.dumps(item) + "\n"
                    yield json.dumps(item) + "\n"
            finally:                       # done, or the client left: nothing keeps running
                executor.abort(rid)
                for t in tasks:
                    t.cancel()

        return StreamingResponse(lines(), media_type="application/x-ndjson",
                                 headers={"x-request-id": rid})

    async def live(request: Request) -> Response:
        return JSONResponse([{"id": r.request_id, "state": r.state, "tokens": r.tokens,
                              "age_s": round(r.age_s, 3)} for r in executor.requests()])

    async def abort(request: Request) -> Response:
        return Response(status_code=204 if executor.abort(request.path_params["rid"]) else 404)

    return Starlette(routes=[Route("/generate", generate, methods=["POST"]),
                             Route("/requests", live, methods=["GET"]),
                             Route("/requests/{rid}", abort, methods=["DELETE"])])


async def ask(c: httpx.AsyncClient, body: dict, rid: str | None = None) -> tuple[str, dict]:
    """One request: its id, and per choice its text, finish reason and logprobs."""
    headers = {"x-request-id": rid} if rid else {}
    out: dict = {}
    async with c.stream("POST", "/generate", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            item = json.loads(line)
            choice = out.setdefault(item["index"], {"text": "", "logprobs": []})
            if "finish" in item:
                choice["finish"] = item["finish"]
            else:
                choice["text"] += item["text"]
                choice["logprobs"].append(item["logprob"])
        return r.headers["x-request-id"], out


async def client(url: str, executor: DeviceExecutor) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        history = "<|user|>\nhello\n<|assistant|>\n"
        for turn in (1, 2):                      # the second turn reuses the first's KV
            rid, out = await ask(c, {"prompt": history, "max_tokens": 8}, f"chat-{turn}")
            history += out[0]["text"] + f"\n<|user|>\nturn {turn + 1}\n<|assistant|>\n"
            print(f"{rid}: {len(out[0]['text'])} chars, {out[0]['finish']}")
        _, full = await ask(c, {"prompt": "stop me", "max_tokens": 12})
        stop = full[0]["text"][4:6]
        _, cut = await ask(c, {"prompt": "stop me", "max_tokens": 12, "stop": [stop]})
        print(f"stop {stop!r}: {cut[0]['finish']}, text is the text before it: "
              f"{full[0]['text'].startswith(cut[0]['text']) and stop not in cut[0]['text']}")
        _, two = await ask(c, {"prompt": "two", "n": 2, "temperature": 1, "seed": 1,
                               "max_tokens": 6, "logprobs": 2})
        print(f"n=2: choices {sorted(two)}, distinct {two[0]['text'] != two[1]['text']}, "
              f"logprobs <= 0 {all(lp <= 0 for ch in two.values() for lp in ch['logprobs'])}")
        long = asyncio.ensure_future(ask(c, {"prompt": "long", "max_tokens": 5000}, "long-1"))
        while not any(r.parent == "long-1" and r.tokens for r in executor.requests()):
            await asyncio.sleep(0.01)
        listed = (await c.get("/requests")).json()
        gone = (await c.delete("/requests/long-1")).status_code
        _, aborted = await long
        print(f"listed {[r['id'] for r in listed]}, DELETE {gone}, "
              f"ended {aborted[0]['finish']}")
        stats = executor.prompt_cache_stats()
        print(f"prompt cache: {stats.hits} hits, {stats.reused_tokens} tokens reused")


async def main() -> None:
    executor = await DeviceExecutor.create(
        realtime_sim(MANIFEST, decode_ms=1), MANIFEST,
        ExecutorConfig(prompt_cache=PromptCacheConfig(max_sequences=4, max_tokens=4096)),
        tokenizer=ByteTokenizer(MANIFEST.submodel(TaskKind.DECODE).vocab))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(executor), host="127.0.0.1", port=port,
                                           log_level="warning"))
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(f"serving on 127.0.0.1:{port}")
    try:
        await client(f"http://127.0.0.1:{port}", executor)
    finally:
        server.should_exit = True
        await serving
        await executor.aclose()


if __name__ == "__main__":
    asyncio.run(main())
