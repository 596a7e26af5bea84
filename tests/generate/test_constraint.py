"""Constrained decoding (issue 37, item 1): ``SamplingParams(constraint=...)``.

The simulated device's logits are noise, for a grammar an adversary: every output must
still parse and validate (``jsonschema``), over generated schemas of varied features
(tests/helpers/schemas.py), regexes and choices, greedy and sampled, ``n = 2``, across a
device reset mid-output; the grammar's end ends a stream ``stop``; a dead end ends it
``error`` with an InvalidArgument naming ``constraint``; logprobs are the masked row's;
stop strings and the prompt cache compose. The quick subset runs in the suite; ``-m
slow`` runs 200 schemas on qwen3-b8 with the realistic tokenizer.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.errors import InvalidArgument
from calfsm.generate.constraint import (
    COUNTS,
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    compile_constraint,
)
from calfsm.generate.processors import ban_tokens
from calfsm.generate.promptcache import PromptCacheConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import FinishReason, GenerationResult
from calfsm.generate.tokenizer import ByteTokenizer
from calfsm.manifest import TaskKind, builtin_manifest
from tests.helpers.executor import (
    TINY,
    HoldAfterWaits,
    drive,
    eventually,
    make_executor,
    make_sim,
)
from tests.helpers.schemas import choices, regexes, schemas

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.timeout(600)

QWEN3_B8 = builtin_manifest("qwen3-b8")
BYTES = ByteTokenizer(TINY.submodel(TaskKind.DECODE).vocab)
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 5}


def run_all(ex: Any, prompt: str, params: Sequence[SamplingParams], *, n: int | None = None,
            batch: int = 8) -> list[GenerationResult]:
    """Each of ``params`` as a stream of ``prompt`` (``batch`` at a time; ``n``: each
    an ``n``-stream generate), driven to the end; the results in order."""
    out: list[GenerationResult] = []
    for lo in range(0, len(params), batch):
        streams = []
        for p in params[lo:lo + batch]:
            made = ex.generate(prompt, p, n=n)
            streams += made if n is not None else [made]
        drive(ex, lambda ss=streams: all(s.done() for s in ss), timeout=300)
        out += [s.result(0) for s in streams]
    return out


def assert_valid_json(results: Sequence[GenerationResult], schema_of: Sequence[dict]) -> None:
    bad = []
    for r, s in zip(results, schema_of, strict=True):
        try:
            assert r.finish_reason == FinishReason.STOP, (r.finish_reason, r.error)
            jsonschema.validate(json.loads(r.text), s)
        except Exception as e:
            bad.append(f"{json.dumps(s)[:160]} -> {r.text!r}: {e}")
    assert not bad, "\n".join(bad[:5])


def assert_matches(results: Sequence[GenerationResult], patterns: Sequence[str]) -> None:
    bad = [(p, r.finish_reason, r.text, r.error) for r, p in zip(results, patterns, strict=True)
           if r.finish_reason != FinishReason.STOP or re.fullmatch(p, r.text) is None]
    assert not bad, bad[:5]


# ---- the values -------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: JsonSchema("{not json"), lambda: JsonSchema([1, 2]), lambda: JsonSchema(True),
    lambda: JsonSchema({"type": "object"}, strict="yes"), lambda: Regex(""),
    lambda: Regex(3), lambda: Choice(()), lambda: Choice(("a", "")), lambda: Choice("ab"),
    lambda: Grammar("  "), lambda: SamplingParams(constraint={"type": "object"}),
])
def test_a_malformed_constraint_is_refused_naming_the_field(make):
    with pytest.raises(InvalidArgument) as e:
        make()
    assert e.value.field == "constraint"


def test_constraints_are_values():
    """Equal when they say the same (a schema's text or dict alike), so the cache of
    compiled grammars finds them."""
    assert JsonSchema({"type": "object"}) == JsonSchema('{"type": "object"}')
    assert hash(JsonSchema({"type": "object"})) == hash(JsonSchema('{"type":"object"}'))
    assert JsonSchema({"type": "object"}) != JsonSchema({"type": "object"}, strict=False)
    assert Choice(["a", "b"]) == Choice(("a", "b"))
    assert SamplingParams(constraint=JsonObject()).constraint == JsonObject()


def test_a_compiled_constraint_is_cached():
    c = JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert compile_constraint(c, BYTES, 1024) is compile_constraint(
        JsonSchema(json.dumps(c.schema)), BYTES, 1024)


@pytest.mark.parametrize("constraint", [
    JsonSchema({"type": "string", "format": "no-such-format"}),
    JsonSchema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    Regex("[a-"), Grammar("start: undefined_rule"),
])
def test_an_unsupported_constraint_is_a_400_before_anything_is_taken(constraint):
    with make_executor("step", tokenizer=BYTES) as ex:
        with pytest.raises(InvalidArgument) as e:
            ex.generate("hi", SamplingParams(constraint=constraint))
        assert e.value.field == "constraint" and e.value.http_status == 400
        assert ex.requests() == []


def test_a_keyword_the_matcher_lacks_is_ignored_when_not_strict():
    schema = {"type": "string", "format": "no-such-format", "maxLength": 4}
    with make_executor("step", tokenizer=BYTES) as ex:
        [r] = run_all(ex, "hi", [SamplingParams(max_tokens=40,
                                                constraint=JsonSchema(schema, strict=False))])
    assert r.finish_reason == FinishReason.STOP and isinstance(json.loads(r.text), str)


def test_without_the_extra_a_constraint_is_a_400_naming_it():
    """llguidance missing (hidden from the import system in a subprocess)."""
    code = """
import sys
sys.modules["llguidance"] = None
from calfsm.generate.tokenizer import ByteTokenizer
from calfsm.generate.constraint import constraints_available, compile_constraint, Regex
from calfsm.errors import InvalidArgument
assert not constraints_available()
try:
    compile_constraint(Regex("a+"), ByteTokenizer(1024), 1024)
except InvalidArgument as e:
    print(e.field, e.http_status, "calfsm[constraints]" in e.message)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["constraint", "400", "True"]


def test_a_constraint_needs_the_tokenizer():
    with make_executor("step") as ex, pytest.raises(InvalidArgument) as e:
        ex.generate([1, 2, 3], SamplingParams(constraint=Regex("a")))
    assert e.value.field == "constraint"


# ---- every output valid: the byte tokenizer on tiny (the vocabulary does not matter) ------

@pytest.mark.parametrize("choose", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_fifty_regexes_match_whole(mode, choose):
    pats = regexes(50)
    with make_executor(mode, tokenizer=BYTES) as ex:
        results = run_all(ex, "text:", [
            SamplingParams(max_tokens=80, constraint=Regex(p), **choose) for p in pats])
    assert_matches(results, pats)


@pytest.mark.parametrize("choose", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_twenty_choices_give_one_option_exactly(choose):
    opts = choices(20)
    with make_executor("step", tokenizer=BYTES) as ex:
        results = run_all(ex, "pick:", [
            SamplingParams(max_tokens=80, constraint=Choice(o), **choose) for o in opts])
    bad = [(o, r.text, r.finish_reason) for o, r in zip(opts, results, strict=True)
           if r.text not in o or r.finish_reason != FinishReason.STOP]
    assert not bad, bad


def test_json_schemas_on_tiny_n2_sampled(mode):
    """40 schemas, each as ``n = 2`` sampled streams: 80 outputs, all valid."""
    sch = schemas(40)
    with make_executor(mode, tokenizer=BYTES) as ex:
        results = run_all(ex, "json:", [
            SamplingParams(max_tokens=400, constraint=JsonSchema(s), **SAMPLED) for s in sch],
            n=2, batch=4)
    assert_valid_json(results, [s for s in sch for _ in range(2)])


def test_any_json_object_and_a_lark_grammar():
    with make_executor("step", tokenizer=BYTES) as ex:
        a, b = run_all(ex, "x", [
            SamplingParams(max_tokens=400, constraint=JsonObject(), **SAMPLED),
            SamplingParams(max_tokens=40, constraint=Grammar(
                'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'), **SAMPLED)])
    assert a.finish_reason == FinishReason.STOP and isinstance(json.loads(a.text), dict)
    assert b.finish_reason == FinishReason.STOP
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", b.text), b.text


# ---- the realistic tokenizer on qwen3-b8 ------------------------------------------------------

QUICK = 12


@pytest.mark.parametrize("choose", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_schemas_on_qwen3_with_the_realistic_tokenizer(qwen_tokenizer, choose):
    sch = schemas(QUICK, start=100 if choose is SAMPLED else 0)
    with make_executor("step", manifest=QWEN3_B8, tokenizer=qwen_tokenizer) as ex:
        results = run_all(ex, "Answer in JSON.", [
            SamplingParams(max_tokens=300, constraint=JsonSchema(s), **choose) for s in sch])
    assert_valid_json(results, sch)


def test_regexes_and_choices_on_qwen3(qwen_tokenizer):
    pats, opts = regexes(50)[::5], choices(20)[::4]
    with make_executor("step", manifest=QWEN3_B8, tokenizer=qwen_tokenizer) as ex:
        results = run_all(ex, "Go.", [
            *(SamplingParams(max_tokens=60, constraint=Regex(p), **SAMPLED) for p in pats),
            *(SamplingParams(max_tokens=60, constraint=Choice(o)) for o in opts)])
    assert_matches(results[:len(pats)], pats)
    assert all(r.text in o and r.finish_reason == FinishReason.STOP
               for r, o in zip(results[len(pats):], opts, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("choose", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_two_hundred_schemas_on_qwen3_n2(qwen_tokenizer, choose):
    """The whole set (``-m slow``): 200 schemas, ``n = 2``, 400 outputs each way."""
    sch = schemas(200)
    with make_executor("threaded", manifest=QWEN3_B8, tokenizer=qwen_tokenizer) as ex:
        results = run_all(ex, "Answer in JSON.", [
            SamplingParams(max_tokens=400, constraint=JsonSchema(s), **choose) for s in sch],
            n=2, batch=4)
    assert_valid_json(results, [s for s in sch for _ in range(2)])


# ---- composition ------------------------------------------------------------------------

@pytest.mark.parametrize("choose", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_reset_mid_output_resumes_with_the_matcher_rebuilt(mode, choose):
    """A CCU exception on the eighth step: the stream resumes (its matcher replays its
    tokens) and gives the fault-free run's output, valid."""
    schema = schemas(7)[6]
    params = SamplingParams(max_tokens=300, constraint=JsonSchema(schema), **choose)
    with make_executor(mode, tokenizer=BYTES) as ex:
        [clean] = run_all(ex, "json:", [params])
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=0, nth=8))
    with make_executor(mode, tokenizer=BYTES, faults=plan) as ex:
        [r] = run_all(ex, "json:", [params])
    assert r.resumes == 1, r
    assert_valid_json([r], [schema])
    assert r.tokens == clean.tokens


def test_logprobs_are_the_masked_rows():
    """Every alternative listed is one the grammar allows, and the allowed tokens' mass
    is the whole row's."""
    with make_executor("step", tokenizer=BYTES) as ex:
        st = ex.generate("pick:", SamplingParams(max_tokens=10, logprobs=5,
                                                 constraint=Choice(("yes", "no"))))
        drive(ex, st.done)
        events = list(st)
    first = events[0]
    assert {t for t, _ in first.top_logprobs} == {ord("y"), ord("n")}
    assert abs(np.logaddexp.reduce([lp for _, lp in first.top_logprobs])) < 1e-9
    assert all(e.top_logprobs[0][1] == pytest.approx(0.0) for e in events[1:])


def test_stop_strings_compose():
    with make_executor("step", tokenizer=BYTES) as ex:
        [r] = run_all(ex, "x", [SamplingParams(max_tokens=40, stop=["STOP"],
                                               constraint=Regex("[a-z]{3}STOP[a-z]{3}"))])
    assert r.finish_reason == FinishReason.STOP and re.fullmatch("[a-z]{3}", r.text), r


def test_the_prompt_cache_composes(mode):
    """The second stream of a prompt starts from the cached prefix; both valid."""
    schema = schemas(3)[2]
    params = SamplingParams(max_tokens=300, constraint=JsonSchema(schema), **SAMPLED)
    cfg = PromptCacheConfig(max_sequences=4, max_tokens=1 << 16)
    with make_executor(mode, tokenizer=BYTES, prompt_cache=cfg) as ex:
        first = run_all(ex, "a long shared prompt " * 4, [params])
        second = run_all(ex, "a long shared prompt " * 4, [params])
    assert second[0].usage.cached_tokens > 0
    assert_valid_json(first + second, [schema, schema])
    assert first[0].tokens == second[0].tokens


def test_the_grammars_end_ends_the_stream_stop_without_a_token():
    """``min_tokens`` and ``ignore_eos`` do not hold a finished grammar open."""
    with make_executor("step", tokenizer=BYTES) as ex:
        [r] = run_all(ex, "x", [SamplingParams(max_tokens=50, min_tokens=20, ignore_eos=True,
                                               constraint=Choice(("done",)))])
    assert (r.finish_reason, r.text, len(r.tokens)) == (FinishReason.STOP, "done", 4)


def test_a_dead_end_is_a_classified_error_not_a_hang():
    """The processors ban the only token the grammar allows: the row ends ``error``
    with an InvalidArgument naming ``constraint``."""
    with make_executor("step", tokenizer=BYTES) as ex:
        [r] = run_all(ex, "x", [SamplingParams(
            max_tokens=10, logits_processors=[ban_tokens([ord("q")])],
            constraint=Regex("abq"))])
    assert r.finish_reason == FinishReason.ERROR and r.text == "ab"
    assert isinstance(r.error, InvalidArgument) and r.error.field == "constraint"
    assert "dead end" in r.error.message


def test_a_user_sampler_choosing_a_banned_token_is_a_dead_end():
    with make_executor("step", tokenizer=BYTES) as ex:
        [r] = run_all(ex, "x", [SamplingParams(max_tokens=10, sampler=lambda row: ord("z"),
                                               constraint=Regex("[ab]+"))])
    assert r.finish_reason == FinishReason.ERROR and r.error.field == "constraint"


def test_the_masks_are_made_off_the_token_path():
    """Nearly every mask is made while the device runs the step (the first one comes
    with the compiled constraint; a late one only when the seeded scheduler completes a
    step before the deferred work runs). Step mode: threaded, how many are late is the
    machine's timing (the next test holds the device instead)."""
    ahead, late = COUNTS.ahead, COUNTS.late
    with make_executor("step", tokenizer=BYTES) as ex:
        results = run_all(ex, "x", [SamplingParams(
            max_tokens=60, constraint=Regex("[a-z]{40}"), **SAMPLED) for _ in range(4)])
    assert_matches(results, ["[a-z]{40}"] * 4)
    made_ahead, made_late = COUNTS.ahead - ahead, COUNTS.late - late
    assert made_ahead >= 4 * 35 and made_late <= 4 * 4, (made_ahead, made_late)


def test_the_mask_for_a_row_is_made_while_the_device_runs_its_step():
    """Threaded: the device holds the step that gives the sixth token; the completion
    side is blocked on it, so the mask for its row can only be made off the path, and
    it is, before the device lets go."""
    held = HoldAfterWaits(make_sim("threaded"))
    with make_executor("threaded", driver=held, tokenizer=BYTES) as ex:
        made = COUNTS.ahead + COUNTS.late
        held.hold_after(5)
        st = ex.generate("x", SamplingParams(max_tokens=30, constraint=Regex("[a-z]{20}")))
        try:
            assert held.held.wait(30)
            assert eventually(lambda: COUNTS.ahead + COUNTS.late - made >= 5), \
                COUNTS.ahead + COUNTS.late - made
            assert not st.done()
        finally:
            held.gate.set()
        r = st.result(30)
    assert r.finish_reason == FinishReason.STOP and re.fullmatch("[a-z]{20}", r.text)
