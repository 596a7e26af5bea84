"""Every refusal at once (issue 34, items 1-3): what a generation's arguments can be judged
by before anything is taken — ``n`` against ``max_sequences`` and ``MAX_N``, ``max_tokens``
against the context left after the prompt, the prompt's ids against the vocabulary and
its length against the context — is raised by the call itself as a non-retryable
InvalidArgument (400), in O(1) memory, with no sequence, buffer or KV taken; and the
server answers the same requests with a 400 naming the field, by the same rule
(calfsm/generate/arguments.py).

Each test went red on main 662cf52: ``generate`` returned a stream that ended in an error
later (bad prompts), ran to the end of the context (``max_tokens`` past it), answered a
retryable 429 (``n`` above ``max_sequences``, a llama context of more sequences) or built
``n`` of everything first (``n = 10**9``: the CPU guard below stops that at once).
"""

from __future__ import annotations

import asyncio
import signal
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from calfsm.engine.results import FinishReason
from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.llama import INVALID_INPUT, LlamaBatch, LlamaContext
from calfsm.manifest import TaskKind
from calfsm.runtime.stepper import StepScheduler
from calfsm.serve import ByteTokenizer, ServerConfig, create_app, realtime_sim
from tests.helpers.executor import TINY, make_executor
from tests.helpers.serve import LiveServer

CONTRACT = TINY.submodel(TaskKind.DECODE)
VOCAB, MAX_SEQ = CONTRACT.vocab, CONTRACT.max_seq
SEQUENCES = 4
PROMPT = [1, 2]
TWO = SamplingParams(max_tokens=2)

pytestmark = pytest.mark.timeout(120)


class Runaway(Exception):
    """The call under test kept the CPU far longer than a refusal takes."""


def guarded(fn: Callable[[], Any], cpu_s: float = 2.0) -> Any:
    """``fn()``, stopped by a Runaway once the process spent ``cpu_s`` of CPU in it (a
    profiling timer: pytest-timeout's SIGALRM is left alone), so a call that builds
    ``n`` of something fails the test quickly instead of eating the machine's memory."""
    def stop(signum: int, frame: Any) -> None:
        raise Runaway(f"still running after {cpu_s} s of CPU")

    old = signal.signal(signal.SIGPROF, stop)
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


def refused(fn: Callable[[], Any]) -> InvalidArgument:
    """The InvalidArgument ``fn()`` raises itself: a 400 that sending again never helps."""
    with pytest.raises(InvalidArgument) as info:
        guarded(fn)
    err = info.value
    assert err.http_status == 400 and not err.retryable and err.retry_after_s is None
    return err


def assert_nothing_taken(ex: DeviceExecutor, accepted: int) -> None:
    """No stream, job, buffer, KV or sequence id is held, and no job was made since
    ``accepted`` (the executor's count before the refusal)."""
    assert ex.requests() == [] and len(ex.live_streams) == 0
    health, stats = ex.health(), ex.stats()
    assert health.ready and health.inflight == 0 and health.queue_depth == 0
    assert stats.accepted == accepted and stats.leased == 0 and stats.admitting == 0
    kv = ex.epoch.kv.stats()
    assert kv.open == 0 and kv.sequences == 0 and kv.budget_used == 0
    held = [ex.open_sequence() for _ in range(SEQUENCES)]     # every id is free
    for seq in held:
        seq.close()


@pytest.fixture
def ex(mode: str) -> Iterator[DeviceExecutor]:
    with make_executor(mode, max_sequences=SEQUENCES, tokenizer=ByteTokenizer(VOCAB)) as e:
        yield e


def drain(ex: DeviceExecutor, streams: list[Any]) -> list[Any]:
    if not ex.config.threaded:
        StepScheduler(ex).run_until(lambda: all(s.done() for s in streams))
    return [s.result(30) for s in streams]


# ---- n ----------------------------------------------------------------------------------

def test_a_huge_n_is_refused_at_once_in_constant_memory(ex):
    accepted = ex.stats().accepted
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        err = refused(lambda: ex.generate(PROMPT, TWO, n=10**9))
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert took < 0.5, took
    assert peak < 256 * 1024, f"{peak} bytes to refuse n = 10**9"
    assert "at most 1024" in err.message           # calfsm.generate.arguments.MAX_N
    assert_nothing_taken(ex, accepted)


def test_n_above_max_sequences_can_never_succeed_so_it_is_a_400_not_a_429(ex):
    accepted = ex.stats().accepted
    err = refused(lambda: ex.generate(PROMPT, TWO, n=SEQUENCES + 1))
    assert f"at most {SEQUENCES}" in err.message and "max_sequences" in err.message
    for bad in (0, -1, True, 1.0, "2"):
        refused(lambda bad=bad: ex.generate(PROMPT, TWO, n=bad))
    assert_nothing_taken(ex, accepted)
    streams = ex.generate(PROMPT, TWO, n=SEQUENCES)       # as many as there are: served
    assert [r.finish_reason for r in drain(ex, streams)] == [FinishReason.LENGTH] * SEQUENCES


# ---- max_tokens and the prompt ------------------------------------------------------------

#: (prompt, params, what the message says): each refused by generate itself
BAD = {
    "max_tokens 10**6": (PROMPT, SamplingParams(max_tokens=10**6), "context holds"),
    "max_tokens 2**63": (PROMPT, SamplingParams(max_tokens=2**63), "context holds"),
    "max_tokens one past the room": ([1] * 100, SamplingParams(max_tokens=MAX_SEQ - 99),
                                     "leaves room for 8092"),
    "token -1": ([5, -1], TWO, "prompt[1] must be a token id"),
    "token V": ([VOCAB], TWO, "prompt[0] must be a token id"),
    "ids longer than max_seq": ([1] * (MAX_SEQ + 1), TWO, "one prefill carries at most"),
    "ids filling max_seq": ([1] * MAX_SEQ, None, "leaves no room"),
    "text longer than max_seq": ("a" * (MAX_SEQ + 5), TWO, "one prefill carries at most"),
    "text filling max_seq": ("ab" * (MAX_SEQ // 2), None, "leaves no room"),
    "empty text": ("", TWO, "at least one token"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_generate_itself_refuses_what_the_context_cannot_hold(ex, case):
    prompt, params, says = BAD[case]
    accepted = ex.stats().accepted
    err = refused(lambda: ex.generate(prompt, params))
    assert says in err.message, err.message
    refused(lambda: ex.generate(prompt, params, n=2))
    assert_nothing_taken(ex, accepted)


def test_what_fits_exactly_runs_and_no_params_clip_the_default_to_the_room(ex):
    near = [3] * (MAX_SEQ - 5)
    exact, default = ex.generate(near, SamplingParams(max_tokens=5)), ex.generate(near)
    r, d = drain(ex, [exact, default])
    assert r.finish_reason == d.finish_reason == FinishReason.LENGTH
    assert len(r.tokens) == len(d.tokens) == 5 and list(r.tokens) == list(d.tokens)


def test_sequence_generate_judges_against_the_room_after_its_position(ex):
    with ex.open_sequence() as seq:
        drain(ex, [seq.generate([7] * 40, SamplingParams(max_tokens=3))])
        at = seq.position
        assert at == 42                 # the prompt and two of the three tokens' KV
        accepted = ex.stats().accepted
        for prompt, params, says in (
                ([1], SamplingParams(max_tokens=MAX_SEQ - at), "at position 42"),
                ([1] * (MAX_SEQ - at), TWO, "after position 42 leaves no room"),
                ([VOCAB + 3], TWO, "must be a token id"), ([-2], TWO, "must be a token id"),
                ("x" * (MAX_SEQ - at), None, "leaves no room")):
            err = refused(lambda p=prompt, q=params: seq.generate(p, q))
            assert says in err.message, err.message
        assert seq.position == at and ex.stats().accepted == accepted   # nothing ran
        last = seq.generate([1], SamplingParams(max_tokens=MAX_SEQ - at - 1))  # fits: runs
        last.cancel()
        drain(ex, [last])


def test_the_asyncio_path_is_refused_before_the_first_await(mode):
    with make_executor(mode, max_sequences=SEQUENCES) as ex:
        accepted = ex.stats().accepted

        async def main() -> list[InvalidArgument]:
            errors = []
            for call in (lambda: ex.generate([-1], TWO), lambda: ex.generate([VOCAB]),
                         lambda: ex.generate(PROMPT, SamplingParams(max_tokens=10**6)),
                         lambda: ex.generate([1] * (MAX_SEQ + 1), TWO),
                         lambda: ex.generate(PROMPT, TWO, n=10**9),
                         lambda: ex.generate(PROMPT, TWO, n=SEQUENCES + 1)):
                errors.append(refused(call))     # raised by the call: nothing to await
            return errors

        assert len(asyncio.run(main())) == 6
        assert_nothing_taken(ex, accepted)


def test_llama_context_of_more_sequences_than_the_executor_opens_is_a_400(mode):
    with make_executor(mode, max_sequences=SEQUENCES) as ex:
        accepted = ex.stats().accepted
        for n in (SEQUENCES + 1, 10**9):
            err = refused(lambda n=n: LlamaContext(ex, n_seq_max=n))
            assert "n_seq_max" in err.message
        assert_nothing_taken(ex, accepted)
        with LlamaContext(ex, n_seq_max=SEQUENCES) as ctx:    # as many as there are
            for tokens in ([-1], [VOCAB], [1] * (MAX_SEQ + 1)):   # judged before any runs
                assert ctx.decode(LlamaBatch.get_one(tokens)) == INVALID_INPUT
            assert ex.stats().accepted == accepted
        assert_nothing_taken(ex, accepted)


# ---- the server: the same rule, a 400 naming the field ------------------------------------

@pytest.fixture(scope="module")
def served() -> Iterator[tuple[DeviceExecutor, LiveServer]]:
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.2, prefill_token_us=1), TINY,
                        ExecutorConfig(max_sequences=SEQUENCES))
    # clients may hold as many choices as they like: only the executor's bound is left
    live = LiveServer(create_app(ex, ServerConfig(max_choices=64, max_client_streams=64)))
    yield ex, live
    live.stop()
    ex.close()


def test_the_server_answers_the_libraries_refusals_with_the_same_400(served):
    ex, live = served
    accepted = ex.stats().accepted
    same_as_library = {
        "n": ({"prompt": PROMPT, "n": SEQUENCES + 1, "max_tokens": 2},
              lambda: ex.generate(PROMPT, TWO, n=SEQUENCES + 1)),
        "prompt": ({"prompt": [5, -1], "max_tokens": 2}, lambda: ex.generate([5, -1], TWO)),
    }
    for param, (body, library) in same_as_library.items():
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny"} | body,
                       timeout=20)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_argument"
        assert error["message"] == refused(library).message
        assert "retry-after" not in r.headers
    for body, param in (
            ({"prompt": PROMPT, "n": 10**9}, "n"),
            ({"prompt": [PROMPT, PROMPT, PROMPT], "n": 2}, "n"),    # 6 choices, 4 sequences
            ({"prompt": PROMPT, "max_tokens": MAX_SEQ - 1}, "max_tokens"),
            ({"prompt": [VOCAB]}, "prompt"),
            ({"prompt": [1] * MAX_SEQ}, "prompt"),
            ({"prompt": "a" * (MAX_SEQ + 1)}, "prompt")):
        t0 = time.perf_counter()
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny"} | body,
                       timeout=20)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert time.perf_counter() - t0 < 5
    assert_nothing_taken(ex, accepted)
    r = httpx.post(live.url + "/v1/completions", timeout=20, json={
        "model": "tiny", "prompt": PROMPT, "n": SEQUENCES, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == SEQUENCES
