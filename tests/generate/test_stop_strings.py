"""Stop strings (issue 23, item 2, "Must show"): with a tokenizer, a stream ends
``stop`` when its text completes a stop string and never delivers it — split across
tokens, inside one token, at the very first token, split inside a character — with the
byte-level tokenizer and a second one (our own multi-character
:class:`~tests.helpers.tokenizer.PieceTokenizer`, always; a Hugging Face byte-level BPE
where ``tokenizers`` installs), in step and in threaded mode. A scripted sampler
(:class:`~tests.helpers.tokenizer.Script`) makes the model say the text each test
chooses. Streams without stop strings deliver the events they delivered before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.results import FinishReason, GenerationResult, TokenEvent
from calfsm.errors import CalrtCode, ErrorCategory, Internal, InvalidArgument
from calfsm.generate.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from calfsm.generate.stopstrings import StopStrings
from calfsm.generate.tokenizer import ByteTokenizer
from tests.helpers.executor import drive, make_executor
from tests.helpers.streams import assert_freed
from tests.helpers.tokenizer import PieceTokenizer, Script, hf_bpe

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7]
TOKENIZERS: dict[str, Callable[[], Any]] = {
    "bytes": lambda: ByteTokenizer(1024), "pieces": PieceTokenizer, "hf": hf_bpe}


@pytest.fixture(params=sorted(TOKENIZERS))
def tok(request) -> Any:
    return TOKENIZERS[request.param]()


# ---- what each tokenizer splits how -------------------------------------------------

def multi_char(tok: Any) -> int:
    """A token whose text has several characters."""
    if isinstance(tok, ByteTokenizer):
        return 700                          # an id >= 256: two escape characters
    if isinstance(tok, PieceTokenizer):
        return tok.id_of(b"x##y")
    return tok.tokenizer.token_to_id("hello")


def euro_split(tok: Any) -> list[int]:
    """The tokens of "€!" with the "€" split between tokens (its first one has no text
    of its own: the decoder holds it)."""
    if isinstance(tok, ByteTokenizer):
        return list("€!".encode())
    if isinstance(tok, PieceTokenizer):
        return [tok.id_of(b"\xe2\x82"), tok.id_of(b"\xac!")]
    return [tok.tokenizer.token_to_id(t) for t in ("âĤ", "¬", "!")]


def lead_byte(tok: Any) -> int:
    """A token that begins "€" and nothing more."""
    if isinstance(tok, ByteTokenizer | PieceTokenizer):
        return 0xE2
    return tok.tokenizer.token_to_id("â")


def ids(tok: Any, *chunks: str | int | list[int]) -> list[int]:
    """The tokens of each chunk in turn: a text's encoding, a token, or tokens."""
    out: list[int] = []
    for c in chunks:
        out += tok.encode(c) if isinstance(c, str) else [c] if isinstance(c, int) else c
    return out


def run(mode: str, tok: Any, script: list[int], stop: Any = (), *,
        max_tokens: int | None = None, **params: Any
        ) -> tuple[list[TokenEvent], GenerationResult]:
    """The events and the result of a stream that plays ``script`` with ``stop``."""
    with make_executor(mode, tokenizer=tok) as ex:
        s = ex.generate(PROMPT, SamplingParams(sampler=Script(script), stop=stop,
                                               max_tokens=max_tokens or len(script),
                                               **params))
        drive(ex, s.done)
        events = list(s)
        r = s.result(10)
        assert_freed(ex)         # the last step may still be ending when the stream has
    assert [e.index for e in events] == list(range(len(events)))
    assert tuple(e.token for e in events) == r.tokens
    return events, r


def assert_stopped(events: list[TokenEvent], r: GenerationResult, text: str,
                   tokens: list[int]) -> None:
    assert r.finish_reason == FinishReason.STOP, r
    assert r.text == "".join(e.text for e in events) == text
    assert list(r.tokens) == tokens and r.usage.completion_tokens == len(tokens)


# ---- the matcher alone --------------------------------------------------------------

_ABC = st.text(alphabet="ab#", max_size=4)


@given(pieces=st.lists(_ABC, max_size=12),
       stops=st.lists(_ABC.filter(bool), min_size=1, max_size=3))
def test_the_matcher_delivers_exactly_the_text_before_the_first_stop_string(pieces, stops):
    """Pieces fed one at a time as a stream feeds them: the text delivered is the text
    before the earliest-beginning stop string of the first prefix (by pieces) that holds
    one, or all of it; what is held back is only ever a beginning of a stop string."""
    matcher = StopStrings(stops)
    held: list[str] = []
    out: list[str] = []
    stopped = False
    for piece in pieces:
        held.append(piece)
        whole, part, stopped = matcher.split(held)
        out += held[:whole] + ([held[whole][:part]] if part is not None else [])
        if stopped:
            break
        held = held[whole:]
        tail = "".join(held)
        assert not tail or any(s.startswith(tail[i:]) for s in stops
                               for i in range(len(tail))), (held, stops)
    else:
        out += held                             # the end: the rest is delivered
    text = ""
    for piece in pieces:
        text += piece
        starts = [text.find(s) for s in stops if s in text]
        if starts:
            assert stopped and "".join(out) == text[:min(starts)]
            return
    assert not stopped and "".join(out) == text


# ---- split across tokens, inside one, at the first ----------------------------------

def test_a_stop_string_split_across_tokens_is_never_delivered(mode, tok):
    """"###" as "#" then "##": the "#" is held back while it may begin the stop string,
    then dropped with it; the text before it is delivered."""
    script = ids(tok, "hello world", "#", "##", " and more")
    events, r = run(mode, tok, script, ("###",))
    assert_stopped(events, r, "hello world", tok.encode("hello world"))
    assert not any("#" in e.text for e in events)


def test_a_stop_string_split_inside_a_character_is_never_delivered(mode, tok):
    """"€!" whose "€" is split between tokens: the token that begins the "€" (it has no
    text of its own yet) is held with it, and never delivered."""
    script = ids(tok, "ab", euro_split(tok), "cd")
    assert tok.decode(script) == "ab€!cd"
    events, r = run(mode, tok, script, "€!")
    assert_stopped(events, r, "ab", tok.encode("ab"))


def test_a_stop_string_inside_one_token_delivers_only_the_text_before_it(mode, tok):
    token = multi_char(tok)
    text = tok.decode([token])
    stop = text[1:-1] if len(text) > 2 else text[1:]
    events, r = run(mode, tok, ids(tok, "ab", token, "cd"), stop)
    assert_stopped(events, r, "ab" + text[0], [*tok.encode("ab"), token])
    assert events[-1].token == token and events[-1].text == text[0]


def test_a_token_straddling_the_start_of_a_stop_string_delivers_the_text_before_it(
        mode, tok):
    """The stop string begins inside a token and ends in the next ones."""
    token = multi_char(tok)
    text = tok.decode([token])
    events, r = run(mode, tok, ids(tok, "ab", token, "Z", "cd"), text[1:] + "Zc")
    assert_stopped(events, r, "ab" + text[0], [*tok.encode("ab"), token])


@pytest.mark.parametrize("where", ["first token", "first two tokens"])
def test_a_stop_string_at_the_very_first_token_delivers_nothing(mode, tok, where):
    token = multi_char(tok)
    text = tok.decode([token])
    stop = text[:1] if where == "first token" else text + "a"
    events, r = run(mode, tok, ids(tok, token, "ab"), stop)
    assert_stopped(events, r, "", [])
    assert events == [] and r.ttft_s is None


def test_the_first_of_several_stop_strings_to_begin_wins(mode, tok):
    events, r = run(mode, tok, ids(tok, "ab", "#", "cd", "#", "ef"), ["d#", "#c", "ef"])
    assert_stopped(events, r, "ab", tok.encode("ab"))


# ---- what does not complete is delivered --------------------------------------------

def test_a_beginning_that_does_not_complete_is_delivered_when_it_fails(mode, tok):
    script = ids(tok, "ab", "#", "#", "c", "#")
    events, r = run(mode, tok, script, "###")
    assert r.finish_reason == FinishReason.LENGTH
    assert r.text == "".join(e.text for e in events) == "ab##c#" == tok.decode(script)
    assert list(r.tokens) == script


def test_a_stop_string_completed_by_the_decoders_flush_ends_stop(mode, tok):
    """The last token begins a character that never completes: the decoder's flush
    gives its text at the end, and a stop string that it completes is not delivered."""
    script = ids(tok, "a", "b", lead_byte(tok))
    tail = tok.decode([lead_byte(tok)])             # U+FFFD, or the byte's escape
    events, r = run(mode, tok, script, "b" + tail)
    assert_stopped(events, r, "a", tok.encode("a"))
    events, r = run(mode, tok, script)              # no stop: the tail is the text's end
    assert r.finish_reason == FinishReason.LENGTH
    assert r.text == tok.decode(script) == "ab" + tail
    assert [e.text for e in events][-1] == ""       # the event itself had no text yet


# ---- token stop sequences beside stop strings ---------------------------------------

@pytest.mark.parametrize("stop, delivered", [("#c", "ab"), ("d!", "ab#"), ((), "ab#")])
def test_a_stop_string_and_a_stop_sequence_the_one_that_begins_first_wins(
        mode, stop, delivered):
    tok = ByteTokenizer(1024)
    events, r = run(mode, tok, ids(tok, "ab#cd!"), stop,
                    stop_sequences=[tuple(b"cd")])
    assert_stopped(events, r, delivered, tok.encode(delivered))


# ---- streams without stop strings ---------------------------------------------------

def test_without_stop_strings_the_events_are_those_without_a_tokenizer(mode, tok):
    """The same tokens, positions and indices as on an executor with no tokenizer,
    which gives no text; with one, each event's text, joined, is ``decode``."""
    script = ids(tok, "hello world ö", euro_split(tok), lead_byte(tok))
    plain = []
    for tokenizer in (None, tok):
        with make_executor(mode, tokenizer=tokenizer) as ex:
            s = ex.generate(PROMPT, SamplingParams(sampler=Script(script),
                                                   max_tokens=len(script)))
            drive(ex, s.done)
            events, r = list(s), s.result(10)
        assert r.finish_reason == FinishReason.LENGTH and list(r.tokens) == script
        plain.append([(e.token, e.position, e.index) for e in events])
        if tokenizer is None:
            assert r.text is None and all(e.text is None for e in events)
        else:
            assert r.text == tok.decode(script)
            assert "".join(e.text for e in events) == tok.decode(script)[:-1]  # the flush
    assert plain[0] == plain[1]


def test_greedy_tokens_with_a_tokenizer_and_a_text_prompt(mode):
    """A text prompt is its encoding; the tokens are the greedy ones either way."""
    tok = ByteTokenizer(1024)
    results = []
    for tokenizer, prompt in ((None, tok.encode("Hello, calfsm")), (tok, "Hello, calfsm")):
        with make_executor(mode, tokenizer=tokenizer) as ex:
            s = ex.generate(prompt, SamplingParams(max_tokens=12))
            drive(ex, s.done)
            results.append(s.result(10))
    assert results[0].tokens == results[1].tokens and len(results[0].tokens) == 12
    assert results[1].text == tok.decode(results[1].tokens) and results[0].text is None


def test_greedy_text_is_stopped_at_a_string_chosen_from_it(mode):
    """The greedy reference tokens' text, a stop string from its middle: the stream
    gives the text before the stop string's first occurrence."""
    tok = ByteTokenizer(1024)
    with make_executor(mode, tokenizer=tok) as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=16))
        drive(ex, s.done)
        full = s.result(10)
        stop = full.text[7:12]
        s = ex.generate(PROMPT, SamplingParams(max_tokens=16, stop=[stop]))
        drive(ex, s.done)
        r = s.result(10)
    cut = full.text.index(stop)
    assert r.finish_reason == FinishReason.STOP and r.text == full.text[:cut]
    assert r.tokens == full.tokens[:len(r.tokens)]


def test_a_resumed_stream_gives_the_fault_free_text_and_stops_the_same(mode):
    """A fault mid-stream, then resume: the replay decodes nothing twice, so the text
    and the stop are those of a fault-free run."""
    tok = ByteTokenizer(1024)
    with make_executor(mode, tokenizer=tok) as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=16))
        drive(ex, s.done)
        full, tokens = s.result(10).text, s.result(0).tokens
    # the text of tokens 10 and 11, well after the fault (at the sixth step)
    before, upto = tok.decode(tokens[:10]), tok.decode(tokens[:12])
    assert full.startswith(upto) and upto.startswith(before)
    stop = upto[len(before):]
    assert full.index(stop) >= len(tok.decode(tokens[:6]))
    params = SamplingParams(max_tokens=16, stop=[stop])
    rule = FaultRule("infer", "code", seq_id=0, nth=6,
                     code=int(CalrtCode.DEVICE_UNAVAILABLE))
    with make_executor(mode, tokenizer=tok, faults=FaultPlan.of(rule)) as ex:
        s = ex.generate(PROMPT, params)
        drive(ex, s.done)
        events, r = list(s), s.result(10)
    assert r.resumes == 1 and r.finish_reason == FinishReason.STOP
    assert r.text == "".join(e.text for e in events) == full[:full.index(stop)]


# ---- checks -------------------------------------------------------------------------

def test_stop_strings_are_checked():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    for bad, match in (([""], r"stop\[0\] must hold 1 to"), ([b"x"], r"stop\[0\] must be a"),
                       (b"x", "stop must be a string or a sequence"), (["a", 3], r"stop\[1\]"),
                       (["a"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS}"),
                       (["a" * (MAX_STOP_CHARS + 1)], f"1 to {MAX_STOP_CHARS} characters"),
                       (7, "stop must be")):
        with pytest.raises(InvalidArgument, match=match):
            SamplingParams(stop=bad)


def test_stop_strings_and_text_prompts_need_the_executors_tokenizer(mode):
    with make_executor(mode) as ex:
        assert ex.tokenizer is None
        with pytest.raises(InvalidArgument, match=r"SamplingParams\.stop.*needs the "
                                                  r"executor's tokenizer"):
            ex.generate(PROMPT, SamplingParams(stop="###"))
        with pytest.raises(InvalidArgument, match="a text prompt needs a tokenizer"):
            ex.generate("hello")
        with ex.open_sequence() as seq:
            assert seq.seq_id == 0                  # nothing was kept by the refusals
            with pytest.raises(InvalidArgument, match=r"SamplingParams\.stop"):
                seq.generate(PROMPT, SamplingParams(stop="###"))
        assert_freed(ex)         # the last step may still be ending when the stream has


def test_the_executor_refuses_what_is_no_tokenizer():
    with pytest.raises(InvalidArgument, match="tokenizer must be a tokenizer"):
        make_executor("step", tokenizer="bytes")


def test_a_decoder_that_fails_ends_the_stream_error_and_frees_everything(mode):
    class Broken(PieceTokenizer):
        def decode(self, ids):
            if 0xE2 in ids:
                raise KeyError("no such piece")
            return super().decode(ids)

    tok = Broken()
    _, r = run(mode, tok, ids(tok, "ab", 0xE2, "cd"), "###")
    assert r.finish_reason == FinishReason.ERROR and r.text == "ab"
    assert isinstance(r.error, Internal) and r.error.stage == "tokenizer"
    assert r.error.category is ErrorCategory.PROGRAMMING
    assert "KeyError" in r.error.message
