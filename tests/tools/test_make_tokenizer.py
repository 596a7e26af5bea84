"""The realistic tokenizer of the qwen3 manifests (issue 37, item 5): a byte-level BPE of
151,936 ids built from the standard library's sources, with Qwen3's added tokens at
Qwen3's ids, cached once per machine (the session fixture ``qwen_tokenizer``, in
tests/conftest.py); it meets the qwen3-b8 manifest's logits in an executor and
``calfsm serve --tokenizer DIR`` in the server."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.tools import make_tokenizer
from tests.helpers.executor import drive, make_executor

QWEN3_B8 = builtin_manifest("qwen3-b8")

pytestmark = pytest.mark.timeout(300)      # the first build on a loaded machine: ~1 min


def test_it_has_the_manifests_vocabulary_and_qwen3s_ids(qwen_tokenizer, qwen_tokenizer_dir):
    tok = qwen_tokenizer
    assert tok.vocab_size == make_tokenizer.VOCAB == QWEN3_B8.submodel(TaskKind.DECODE).vocab
    hf = tok.tokenizer
    for text, want in (("<|endoftext|>", 151643), ("<|im_start|>", 151644),
                       ("<|im_end|>", 151645), ("<tool_call>", 151657),
                       ("</tool_call>", 151658), ("<think>", 151667), ("</think>", 151668)):
        assert hf.token_to_id(text) == want, text
        assert tok.encode(text) == [want]
    info = json.loads((qwen_tokenizer_dir / "calfsm-build.json").read_text())
    assert info["learned_bpe"] > 100_000          # a real BPE, not a padded byte table
    assert qwen_tokenizer_dir.parent.parent == make_tokenizer.cache_dir()


@pytest.mark.parametrize("text", [
    "def main(argv: list[str] | None = None) -> int:\n    return 0\n",
    "The quick brown fox jumps over the lazy dog.",
    "Grüße, 日本語, emoji 🎉 and \u00a0non-breaking\tspaces\r\n",
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}',
])
def test_text_round_trips_and_compresses(qwen_tokenizer, text):
    ids = qwen_tokenizer.encode(text)
    assert qwen_tokenizer.decode(ids) == text
    if text.isascii():
        assert len(ids) < len(text) / 2.5         # merges learned from real source text


def test_every_id_decodes(qwen_tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(make_tokenizer.VOCAB) for _ in range(2000)] + [151935, 0]
    dec = qwen_tokenizer.incremental()
    text = "".join(dec.push(t) for t in ids) + dec.flush()
    assert isinstance(text, str)


def test_its_chat_template_renders_a_tool_round_trip(qwen_tokenizer):
    text = qwen_tokenizer.chat_template.render(
        [{"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
         {"role": "tool", "content": "rain"}],
        tools=[{"type": "function", "function": {"name": "get_weather"}}])
    assert text.endswith("<|im_start|>user\n<tool_response>\nrain\n</tool_response>"
                         "<|im_end|>\n<|im_start|>assistant\n")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
           '</tool_call><|im_end|>' in text
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(151644) == 5 and ids.count(151657) == 2   # the instructions name it too


def test_qwen3_b8_meets_text_through_it(qwen_tokenizer):
    with make_executor("step", manifest=QWEN3_B8, tokenizer=qwen_tokenizer) as ex:
        streams = [ex.generate(p, SamplingParams(max_tokens=6, temperature=t, seed=1))
                   for p, t in (("Hello, calfsm", 0.0), ("import os\n", 1.0))]
        drive(ex, lambda: all(s.done() for s in streams))
        for s in streams:
            r = s.result(10)
            assert len(r.tokens) == 6
            assert r.text == qwen_tokenizer.decode(r.tokens)
    assert r.usage.prompt_tokens == len(qwen_tokenizer.encode("import os\n"))


def test_calfsm_serve_tokenizer_option(qwen_tokenizer, qwen_tokenizer_dir):
    from tests.helpers.serve import Serving, poll
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a generator in Python?"}]
    srv = Serving("--manifest", "qwen3-b1", "--tokenizer", str(qwen_tokenizer_dir))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            poll(lambda: c.get("/ready").status_code == 200, 60,
                 "calfsm serve never became ready", every=0.05)
            r = c.post("/v1/chat/completions", json={
                "model": "qwen3-b1", "messages": messages, "max_tokens": 3})
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    want = qwen_tokenizer.encode(qwen_tokenizer.chat_template.render(messages),
                                 add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(want)
