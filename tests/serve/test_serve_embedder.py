"""What an embedder reaches for, through ``calfsm serve`` with the official ``openai``
client (issue 23, "Must show"): ``n`` choices (each the seeded run of ``seed + i``),
``logprobs``, ``stop`` strings (never delivered, finish reason ``stop``) and an
``X-Request-Id`` round trip (given: answered back and named in the server's errors;
absent: one is generated), in one request, streaming and not."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.serve.tokenizer import ByteTokenizer
from tests.helpers.executor import reference_stream
from tests.helpers.serve_load import start_serve
from tests.helpers.streams import direct_runner

TINY = builtin_manifest("tiny")
TOK = ByteTokenizer(TINY.submodel(TaskKind.DECODE).vocab)
PROMPT = "Continue this, please:"
N, SEED, MAX_TOKENS = 3, 5, 24

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def oai() -> Any:
    proc, port = start_serve("--manifest", "tiny", "--decode-ms", "1")
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                            max_retries=0, timeout=60)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def reference_tokens(i: int) -> list[int]:
    """Choice ``i``'s tokens without a stop: the seeded run of ``SEED + i``."""
    params = SamplingParams(temperature=0.9, seed=SEED + i, max_tokens=MAX_TOKENS)
    runner = direct_runner()
    return reference_stream(runner, TOK.encode(PROMPT), params)


def reference_text(i: int) -> str:
    return TOK.decode(reference_tokens(i))


def stop_of(tokens: list[int]) -> str:
    """A stop string out of the middle of a choice: one token's text (the byte
    tokenizer writes an id >= 256 as two reserved characters, which only ever match
    where a token begins)."""
    return TOK.decode([tokens[len(tokens) // 2]])


def expected(i: int, stop: str) -> tuple[str, str]:
    """Choice ``i``'s text and finish reason with ``stop``."""
    text = reference_text(i)
    cut = text.find(stop)
    return (text, "length") if cut < 0 else (text[:cut], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_logprobs_stop_and_request_id_in_one_completion(oai, stream):
    stop = stop_of(reference_tokens(0))
    want = [expected(i, stop) for i in range(N)]
    assert want[0][1] == "stop"
    kw = dict(model="tiny", prompt=PROMPT, n=N, seed=SEED, temperature=0.9,
              max_tokens=MAX_TOKENS, logprobs=2, stop=[stop],
              extra_headers={"X-Request-Id": f"embedder-{stream}"})
    raw = oai.completions.with_raw_response.create(stream=stream, **kw)
    assert raw.headers["x-request-id"] == f"embedder-{stream}"
    texts, reasons, lps = [""] * N, [None] * N, [[] for _ in range(N)]
    for out in (raw.parse() if stream else [raw.parse()]):
        for c in out.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
            if c.logprobs is not None:
                lps[c.index] += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs,
                                         c.logprobs.top_logprobs, strict=True))
    assert list(zip(texts, reasons, strict=True)) == want
    for i in range(N):
        assert stop not in texts[i]
        assert lps[i], f"choice {i} has no logprobs"
        for _token, lp, top in lps[i]:
            assert lp <= 0 and len(top) == 2
            assert max(top.values()) >= lp - 1e-9 or lp in top.values()


def test_chat_with_n_and_a_generated_request_id(oai):
    raw = oai.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, seed=3,
        temperature=1.0, max_tokens=8, logprobs=True, top_logprobs=1)
    assert raw.headers["x-request-id"].startswith("req-")
    out = raw.parse()
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(len(c.logprobs.content) >= 1 for c in out.choices)


def test_a_bad_request_id_is_a_400_naming_the_header(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", max_tokens=1,
                               extra_headers={"X-Request-Id": "has space"})
    assert "x-request-id" in e.value.body["message"]
    assert e.value.body["param"].lower() == "x-request-id"
    assert e.value.response.headers.get("x-request-id") is None
