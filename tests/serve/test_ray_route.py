"""The prompt-cache router's parts without a Ray cluster (issue 38, item 5): routing
keys, the prefixes a replica holds and a router's view of them, the ranking Ray is given,
a backend answering a forwarded request in process, and ``/metrics``' per-replica
counters. tests/serve/test_ray_serve.py runs them on Ray. Needs the ``ray`` extra."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.promptcache import PromptCacheConfig
from calfsm.serve.ray_route import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    CalfsmBackend,
    Candidate,
    ForwardedRequest,
    HeldPrefixes,
    ReplicaCounters,
    ReplicaPrefixes,
    rank,
    routing_key,
    with_replica_counters,
)
from calfsm.serve.realtime import realtime_sim
from tests.helpers.serve import MODEL, TINY, TOK, params_of, reference, samples

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def body(**doc: Any) -> bytes:
    return json.dumps(doc).encode()


# ---- routing keys -----------------------------------------------------------------------
def test_a_turn_key_extends_the_key_of_the_turn_before():
    turn1 = list(range(1, 2 * BLOCK_TOKENS + 5))
    turn2 = turn1 + [9] * (3 * BLOCK_TOKENS)
    k1, k2 = routing_key(COMPLETIONS, body(prompt=turn1)), routing_key(COMPLETIONS,
                                                                         body(prompt=turn2))
    assert len(k1) == 2 and k2[:2] == k1 and len(k2) == 5   # whole blocks only
    other = routing_key(COMPLETIONS, body(prompt=[5, *turn1[1:]]))
    assert other[0] != k1[0]                                # a different first block
    # text prompts, a batch (its first prompt) and chats, message by message
    text = "x" * (2 * BLOCK_BYTES)
    assert routing_key(COMPLETIONS, body(prompt=text)) \
        == routing_key(COMPLETIONS, body(prompt=[text, "other"]))
    chat1 = [{"role": "user", "content": "y" * BLOCK_BYTES}]
    chat2 = [*chat1, {"role": "assistant", "content": "z" * BLOCK_BYTES},
             {"role": "user", "content": [{"type": "text", "text": "w" * BLOCK_BYTES}]}]
    c1, c2 = routing_key(CHAT, body(messages=chat1)), routing_key(CHAT, body(messages=chat2))
    assert c1 and c2[:len(c1)] == c1 and len(c2) > len(c1)
    # the same tokens as text, as ids and as a chat are three keys
    assert len({routing_key(COMPLETIONS, body(prompt=text))[0],
                routing_key(CHAT, body(messages=[{"role": "", "content": text}]))[0],
                routing_key(COMPLETIONS, body(prompt=list(range(40))))[0]}) == 3


@pytest.mark.parametrize("path,raw", [
    (COMPLETIONS, body(prompt=[1, 2, 3])),              # shorter than one block
    (COMPLETIONS, b"{not json"),
    (COMPLETIONS, b"[" * 100_000),                      # too deep for json: no key
    (COMPLETIONS, body(prompt=[True] * 40)),
    (COMPLETIONS, body(prompt=None)),
    (CHAT, body(messages="hi")),
    ("/v1/models", body(prompt=list(range(40)))),
])
def test_no_key_when_the_body_names_no_usable_prompt(path, raw):
    assert routing_key(path, raw) == ()


# ---- what a replica holds, and a router's view of it ----------------------------------
def test_held_prefixes_mirror_the_cache_take_and_keep():
    held = HeldPrefixes()
    held.add((1, 2))
    held.add((7, 8))
    held.add((1, 2, 3, 4))          # the next turn takes (1, 2)'s place
    assert len(held) == 2 and held.chains() == [(7, 8), (1, 2, 3, 4)]
    assert held.match((1, 2, 3, 9)) == 3 and held.match((7, 9)) == 1 and held.match((5,)) == 0
    held.drop_oldest(1)             # the cache evicted its least recently used
    assert held.chains() == [(1, 2, 3, 4)] and held.match((7, 8)) == 0
    held.clear()
    assert len(held) == 0 and held.match((1,)) == 0
    # a key sharing even one block takes that entry's place, as the cache's take does
    for key in ((1, 2), (4,), (1, 3), (1, 3, 5), (1, 3, 5)):
        held.add(key)
    assert held.chains() == [(4,), (1, 3, 5)] and sorted(held.hashes()) == [1, 3, 4, 5]


def test_a_router_sees_what_it_routed_until_a_report_covers_it():
    view = ReplicaPrefixes(margin_s=2.0)
    view.routed((1, 2), now=100.0)
    assert view.match((1, 2, 3)) == 2 and view.held() == 1
    view.report({"at": 101.0, "hashes": [1, 2], "entries": 1})     # too soon to drop
    assert view.held() == 1 and view.match((1, 2)) == 2
    view.routed((5, 6), now=104.0)
    view.report({"at": 103.0, "hashes": [], "entries": 0})  # (1, 2) was evicted since
    assert view.match((1, 2)) == 0 and view.match((5, 6)) == 2 and view.held() == 1
    view.report({"at": 103.0, "hashes": [9], "entries": 1})     # seen before: no change
    assert view.match((9,)) == 0
    view.report(None)
    view.report({"at": 200.0, "hashes": [5, 6, 7, 1], "entries": 2})
    assert view.match((5, 6, 7, 8)) == 3 and view.match((1, 3)) == 1 and view.held() == 2


def test_ranks_put_the_longest_prefix_first_unless_its_replica_is_far_busier():
    a, b, c = (Candidate("a", 3, 5, 2), Candidate("b", 1, 0, 0),
               Candidate("c", 0, 1, 0))
    assert rank([a, b, c]) == [["a"], ["b", "c"]]
    assert rank([a, b, c], imbalanced_threshold=1) == [["b", "c", "a"]]
    assert rank([a, b, c], min_match_blocks=4) == [["b", "c", "a"]]
    # no prefix anywhere: one rank, the emptiest cache first (Ray takes the least
    # loaded, the first of equals)
    assert rank([Candidate("x", 0, 4, 0), Candidate("y", 0, 1, 0)]) == [["y", "x"]]
    assert rank([Candidate("x", 2, 4, 0), Candidate("y", 2, 1, 0)]) == [["x", "y"]]
    assert rank([]) == []


# ---- a backend in process -------------------------------------------------------------
def scope(path: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2), "headers": [(b"content-type", b"application/json")]}


async def call(backend: CalfsmBackend, prompt: list[int]) -> tuple[dict[str, Any],
                                                                   ReplicaCounters]:
    raw = body(model=MODEL, prompt=prompt, temperature=0, max_tokens=4)
    items = [m async for m in backend.handle(
        ForwardedRequest(scope(COMPLETIONS), raw, routing_key(COMPLETIONS, raw)))]
    *messages, counters = items
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    return json.loads(b"".join(m.get("body", b"") for m in messages[1:])), counters


def test_a_backend_answers_forwarded_requests_and_reports_what_it_keeps():
    def build() -> DeviceExecutor:
        return DeviceExecutor(realtime_sim(TINY, decode_ms=0.2), TINY, ExecutorConfig(
            max_sequences=8, prompt_cache=PromptCacheConfig(2, 4096)))

    backend = CalfsmBackend(build)
    try:
        convs = [[c + 1] * (2 * BLOCK_TOKENS) for c in range(3)]

        async def trace() -> tuple[list[tuple[dict[str, Any], ReplicaCounters]],
                                   list[int]]:
            out = [await call(backend, convs[0]), await call(backend, convs[1])]
            turn2 = convs[0] + TOK.encode(out[0][0]["choices"][0]["text"]) + [9] * 20
            out.append(await call(backend, turn2))          # a hit: conv 0's entry
            out.append(await call(backend, convs[2]))       # the cache (2) evicts conv 1
            return out, turn2

        answers, turn2 = asyncio.run(trace())
        first, _ = answers[0]
        assert TOK.encode(first["choices"][0]["text"]) \
            == reference(convs[0], params_of({"temperature": 0, "max_tokens": 4}))
        assert [c.hits for _, c in answers] == [0, 0, 1, 1]
        assert answers[2][1].reused_tokens \
            == answers[2][0]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        report = asyncio.run(backend.record_routing_stats())
        view = ReplicaPrefixes()
        view.report(report)
        assert report["entries"] == 2                       # conv 0's turn 2, conv 2
        assert view.match(routing_key(COMPLETIONS, body(prompt=convs[1]))) == 0
        assert view.match(routing_key(COMPLETIONS, body(prompt=convs[2]))) == 2
        assert view.match(routing_key(COMPLETIONS, body(prompt=turn2))) \
            == len(routing_key(COMPLETIONS, body(prompt=turn2)))
        # an unchanged cache is the same report (Ray passes on only a change)
        assert asyncio.run(backend.record_routing_stats()) == report
    finally:
        backend.executor.close()


# ---- /metrics through the front -------------------------------------------------------
REPLICAS = [ReplicaCounters("r1", 3, 120), ReplicaCounters("r2", 0, 0)]


def metrics_answer(ctype: bytes, text: bytes, status: int = 200) -> list[dict[str, Any]]:
    return [{"type": "http.response.start", "status": status,
             "headers": [(b"content-type", ctype), (b"content-length", b"1")]},
            {"type": "http.response.body", "body": text[:5], "more_body": True},
            {"type": "http.response.body", "body": text[5:]}]


@pytest.mark.parametrize("ctype,text", [
    (b"text/plain; version=0.0.4", b"# HELP x_total X.\n# TYPE x_total counter\nx_total 1.0\n"),
    (b"application/openmetrics-text; version=1.0.0",
     b"# HELP x X.\n# TYPE x counter\nx_total 1.0\n# EOF\n"),
])
def test_metrics_gain_each_replicas_prompt_cache_counters(ctype, text):
    start, out = with_replica_counters(metrics_answer(ctype, text), REPLICAS)
    got = out["body"]
    assert dict(start["headers"])[b"content-length"] == str(len(got)).encode()
    if ctype.startswith(b"application/openmetrics"):
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
        assert got.endswith(b"# EOF\n") and got.count(b"# EOF") == 1
        found = {(s.name, s.labels.get("replica")): s.value
                 for f in text_string_to_metric_families(got.decode()) for s in f.samples}
    else:
        found = {(k[0], dict(k[1]).get("replica")): v
                 for k, v in samples(got.decode()).items()}
    assert found[("x_total", None)] == 1
    assert found[("calfsm_replica_prompt_cache_hits_total", "r1")] == 3
    assert found[("calfsm_replica_prompt_cache_hits_total", "r2")] == 0
    assert found[("calfsm_replica_prompt_cache_reused_tokens_total", "r1")] == 120


def test_an_error_answer_to_metrics_is_passed_on_untouched():
    answer = metrics_answer(b"application/json", b'{"error": {}}', status=503)
    assert with_replica_counters(answer, REPLICAS) == answer
