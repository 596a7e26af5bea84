"""The prompt cache (issue 23, item 5, "Must show"), on the simulated device and the
native emulator, in step mode (seeded interleavings, virtual clock) and threaded mode:

- A second turn takes the first turn's sequence: its prefill job covers only the new
  tokens (``past_len`` = the reused prefix), and its tokens equal a fresh executor's,
  greedy and seeded; a cancelled stream's sequence is kept with exactly what its KV holds.
- Hypothesis over random chat transcripts (several chats sharing a system prompt, turns
  appended, histories cut and diverging, a few streams at once, greedy and seeded): every
  turn gives the reference's tokens, no stream is refused while cached sequences hold
  every sequence id, and a reset empties the cache.
- Room: with every sequence id cached, as many new streams start at once with no 429;
  with the device's KV full of cached sequences, a new stream is admitted in time.
- A reset (``recover()``) empties the cache, counted, and gives every id back; a hit
  whose first step a drain fails resumes with the whole prompt.
- A sequence the caller opened is never cached; the budget evicts the least recently
  used, by sequences and by tokens; ``close()`` releases every cached KV.
- The statistics and the Prometheus rows count hits, misses, reused tokens, evictions.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calfsm import PromptCacheConfig
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.sim import LatencyModel
from calfsm.engine.observe import JobAccepted, Observer
from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import FinishReason, GenerationResult, Stream, Usage
from calfsm.machines.sequence import SequenceState
from calfsm.manifest import TaskKind
from calfsm.runtime.stepper import StepScheduler
from calfsm.tools.direct import DirectRunner
from tests.helpers.executor import TINY, drive, make_sim, reference_stream, settle
from tests.helpers.streams import direct_runner
from tests.helpers.streams import settled as ended_and_released

VOCAB = TINY.submodel(TaskKind.DECODE).vocab
GREEDY = SamplingParams(max_tokens=8)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11, max_tokens=8)
BIG = PromptCacheConfig(max_sequences=8, max_tokens=1 << 20)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(params=["sim", "emulator"])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def runner() -> DirectRunner:
    """A fresh run of each prompt on the direct path: the reference."""
    return direct_runner()


def make_driver(device: str, mode: str, **kw: Any) -> Any:
    """The simulated device or the native emulator: a virtual clock in step mode, real
    time with no device latency in threaded mode."""
    if device == "sim":
        return make_sim(mode, **kw)
    if mode == "step":
        return CalrtDriver.virtual(manifest_or_calbin=TINY, **kw)
    return CalrtDriver(TINY, latency=LatencyModel.zero(), **kw)


def make(mode: str, device: str = "sim", *, cache: PromptCacheConfig | None = BIG,
         driver_kw: dict | None = None, **config: Any) -> DeviceExecutor:
    drv = make_driver(device, mode, **(driver_kw or {}))
    ex = DeviceExecutor(drv, TINY, ExecutorConfig(threaded=mode == "threaded",
                                                  prompt_cache=cache, **config))
    ex.jobs = JobLog()                  # type: ignore[attr-defined]
    ex.add_observer(ex.jobs)
    return ex


class JobLog(Observer):
    """Every prefill accepted, as (sequence, past_len, tokens), and every refusal."""

    def __init__(self) -> None:
        self.prefills: list[tuple[int, int, int]] = []
        self.rejected: list[Any] = []

    def job_accepted(self, event: JobAccepted) -> None:
        if event.kind is TaskKind.PREFILL_IDS:
            r = event.request
            self.prefills.append((r.seq_id, r.past_len, r.token_count))

    def request_rejected(self, error: Any, reason: str) -> None:
        self.rejected.append((reason, error))


def run(ex: DeviceExecutor, prompt: list[int], params: SamplingParams = GREEDY, *,
        seed: int = 0) -> GenerationResult:
    """One stream to its end, and until its sequence is cached or released."""
    stored = _stored(ex)
    return settled(ex, ex.generate(prompt, params), stored, seed=seed)


def _stored(ex: DeviceExecutor) -> int:
    stats = ex.prompt_cache_stats()
    return 0 if stats is None else stats.stored


def settled(ex: DeviceExecutor, s: Stream, stored: int, *, seed: int = 0
            ) -> GenerationResult:
    """Drive until ``s`` ended, its sequence was kept (the cache had stored ``stored``
    before it started) or released, and all is idle."""
    def handed_over() -> bool:
        return s.sequence.state == SequenceState.RELEASED or _stored(ex) > stored

    drive(ex, lambda: s.done() and handed_over() and ex.idle(), seed=seed)
    return s.result(0)


def tokens(n: int, start: int) -> list[int]:
    return [(start + 37 * i) % VOCAB for i in range(n)]


def fresh(mode: str, device: str, prompt: list[int], params: SamplingParams
          ) -> tuple[int, ...]:
    with make(mode, device, cache=None) as ex:
        return run(ex, prompt, params).tokens


# ---- reuse ------------------------------------------------------------------------

@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_second_turn_prefills_only_its_new_tokens_and_equals_a_fresh_run(
        mode, device, params):
    first = tokens(60, 5)
    with make(mode, device) as ex:
        r1 = run(ex, first, params)
        assert r1.usage == Usage(60, 8, 0)
        assert ex.prompt_cache_stats().sequences == 1
        second = first + list(r1.tokens) + tokens(5, 900)
        r2 = run(ex, second, params)
        # the KV held the first prompt and every token but the last (never decoded)
        reused = 60 + 8 - 1
        assert ex.jobs.prefills[-1][1:] == (reused, len(second) - reused)
        assert r2.usage.cached_tokens == reused and r2.usage.prompt_tokens == len(second)
        st_ = ex.prompt_cache_stats()
        assert (st_.hits, st_.misses, st_.reused_tokens, st_.stored) == (1, 1, reused, 2)
        assert (st_.sequences, st_.tokens) == (1, len(second) + 8 - 1)
        assert ex.jobs.rejected == []
    assert r2.tokens == fresh(mode, device, second, params)
    assert r1.tokens == fresh(mode, device, first, params)


def test_a_shorter_prompt_truncates_the_cached_kv(mode, device, runner):
    """A prompt that diverges inside the cached history (an edited message) reuses the
    common part only: the KV past it is released, and the tokens are a fresh run's."""
    first = tokens(80, 3)
    with make(mode, device) as ex:
        run(ex, first)
        edited = first[:30] + tokens(4, 500)
        r = run(ex, edited)
        assert ex.jobs.prefills[-1][1:] == (30, 4)
        seq = ex.jobs.prefills[-1][0]
        assert ex.epoch.kv.sequence_length(seq) == 34 + 8 - 1
    assert list(r.tokens) == reference_stream(runner, edited, GREEDY)


def test_the_whole_prompt_cached_still_prefills_its_last_token(mode, runner):
    """Resending a prompt the cache holds entirely: its last token is prefilled again,
    which gives the first token's logits."""
    p = tokens(40, 7)
    with make(mode) as ex:
        run(ex, p + tokens(3, 1))
        r = run(ex, p)
        assert ex.jobs.prefills[-1][1:] == (39, 1)
    assert list(r.tokens) == reference_stream(runner, p, GREEDY)


def test_a_cancelled_stream_is_kept_with_what_its_kv_holds(runner):
    """Cancelled after three tokens, a step still on the device: the sequence is kept
    when that step has ended, its history exactly its KV, and the next turn built on the
    tokens delivered gives a fresh run's tokens."""
    p = tokens(50, 11)
    with make("step") as ex:
        stored = _stored(ex)
        s = ex.generate(p, SamplingParams(max_tokens=50))
        sched = StepScheduler(ex, 3)
        sched.run_until(lambda: len(s._tokens) >= 3)
        s.cancel()
        r = settled(ex, s, stored)
        assert r.finish_reason is FinishReason.CANCELLED
        stats = ex.prompt_cache_stats()
        assert stats.sequences == 1
        assert stats.tokens == ex.epoch.kv.sequence_length(s.sequence.seq_id) >= 50 + 2
        nxt = p + list(r.tokens) + tokens(3, 77)
        r2 = run(ex, nxt)
        assert r2.usage.cached_tokens >= len(p)
    assert list(r2.tokens) == reference_stream(runner, nxt, GREEDY)


def test_a_kept_sequence_holds_its_kv_not_its_last_results():
    """A cached sequence forgets its ended jobs (their results hold the stream's logits
    rows); the stream is freed by reference counting as without the cache."""
    import gc
    import weakref

    with make("step") as ex:
        stored = _stored(ex)
        s = ex.generate(tokens(30, 4), GREEDY)
        gone = weakref.ref(s)
        seq = s.sequence
        gc.disable()
        try:
            settled(ex, s, stored)
            assert seq.last_job is None and seq.position == 30 + 8 - 1
            del s
            drive(ex, ex.idle)
            assert gone() is None
        finally:
            gc.enable()
        r = run(ex, [*tokens(30, 4), 1, 2])
        assert r.usage.cached_tokens == 30


# ---- random chat transcripts ------------------------------------------------------

@st.composite
def transcripts(draw: Any) -> tuple[list[int], list[list[tuple]]]:
    """A system prompt every chat begins with, and rounds of turns run at once: (chat,
    cut, user tokens, max_tokens, seeded). ``cut``: the history is cut there first (an
    edited or regenerated message: the history diverges from what is cached)."""
    system = draw(st.lists(st.integers(0, VOCAB - 1), max_size=24))
    chats = draw(st.integers(1, 6))
    turn = st.tuples(st.integers(0, chats - 1),
                     st.one_of(st.none(), st.none(), st.integers(0, 120)),
                     st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
                     st.integers(1, 6), st.booleans())
    rounds = draw(st.lists(st.lists(turn, min_size=1, max_size=3), min_size=1,
                           max_size=8))
    return system, rounds


@pytest.mark.parametrize("device", ["sim", "emulator"])
@settings(max_examples=40)
@given(transcript=transcripts(), seed=st.integers(0, 2**16))
def test_random_chats_give_a_fresh_runs_tokens_never_a_429_and_a_reset_empties_it(
        device, transcript, seed, runner):
    system, rounds = transcript
    history: dict[int, list[int]] = {}
    # three sequence ids, all of which the cache may hold (more chats than ids: a new
    # stream often needs one a cached sequence holds), and a budget a few turns fill
    with make("step", device, max_sequences=3,
              cache=PromptCacheConfig(max_sequences=3, max_tokens=64)) as ex:
        sched = StepScheduler(ex, seed)
        launched = 0
        for turns in rounds:
            live = []
            for chat, cut, user, max_tokens, seeded in turns:
                if any(c == chat for c, *_ in live):
                    continue                # a chat sends its next turn after the answer
                past = history.get(chat, list(system))
                if cut is not None:
                    past = past[:cut]
                prompt = past + user
                params = SamplingParams(temperature=0.8, seed=chat + 1,
                                        max_tokens=max_tokens) if seeded \
                    else SamplingParams(max_tokens=max_tokens)
                live.append((chat, prompt, params, ex.generate(prompt, params)))
                launched += 1
            sched.run_until(lambda live=live: all(s.done() for *_, s in live)
                            and ex.idle())
            for chat, prompt, params, s in live:
                r = s.result(0)
                assert r.finish_reason is FinishReason.LENGTH, r
                assert list(r.tokens) == reference_stream(runner, prompt, params)
                history[chat] = prompt + list(r.tokens)
        assert ex.jobs.rejected == []
        stats = ex.prompt_cache_stats()
        assert stats.hits + stats.misses == launched
        assert stats.tokens <= 64 and stats.sequences <= 3
        held = stats.sequences
        ex.recover("test: the KV is lost")
        settle(ex)
        after = ex.prompt_cache_stats()
        assert (after.sequences, after.tokens) == (0, 0)
        assert after.evictions["reset"] == stats.evictions["reset"] + held
        drive(ex, ex.idle)
        seqs = [ex.open_sequence() for _ in range(3)]      # every id came back
        for s in seqs:
            s.close()


# ---- room: a cached sequence never refuses work -----------------------------------

def test_cached_sequences_holding_every_id_never_refuse_a_new_stream(mode, device):
    n = 4
    with make(mode, device, max_sequences=n) as ex:
        for i in range(n):
            run(ex, tokens(20, 100 * i + 1))
        assert ex.prompt_cache_stats().sequences == n
        streams = [ex.generate(tokens(20, 100 * i + 50), GREEDY) for i in range(n)]
        drive(ex, lambda: all(s.done() for s in streams) and ex.idle())
        assert all(s.result(0).finish_reason is FinishReason.LENGTH for s in streams)
        stats = ex.prompt_cache_stats()
        assert stats.evictions["room"] == n and stats.misses == 2 * n
        assert ex.jobs.rejected == []
        # and open_sequence, the caller's entry, evicts as well
        held = ex.prompt_cache_stats().sequences
        with ex.open_sequence():
            assert ex.prompt_cache_stats().sequences == held - 1


def test_cached_sequences_filling_the_device_kv_yield_to_a_new_stream(mode, device):
    """The device holds 300 KV positions: three cached sequences take 270 of them. A
    100-token prompt is refused KV by the device; cached sequences are released until it
    fits, and it runs within its admission deadline."""
    with make(mode, device, driver_kw={"kv_capacity": 300},
              admission_timeout_s=5.0) as ex:
        for i in range(3):
            run(ex, tokens(83, 200 * i + 3))
        assert ex.prompt_cache_stats().tokens == 3 * 90
        r = run(ex, tokens(100, 999))
        assert r.finish_reason is FinishReason.LENGTH and r.error is None
        stats = ex.prompt_cache_stats()
        assert stats.evictions["room"] == 1            # one was enough room
        assert (stats.sequences, stats.tokens) == (3, 2 * 90 + 107)
        assert ex.jobs.rejected == []


# ---- resets -----------------------------------------------------------------------

def test_a_reset_empties_the_cache_counted_and_the_next_turn_is_fresh(mode, device, runner):
    p = tokens(40, 9)
    with make(mode, device) as ex:
        r1 = run(ex, p)
        run(ex, tokens(30, 400))
        assert ex.prompt_cache_stats().sequences == 2
        assert ex.recover("test")
        settle(ex)
        drive(ex, ex.idle)
        stats = ex.prompt_cache_stats()
        assert (stats.sequences, stats.tokens, stats.evictions["reset"]) == (0, 0, 2)
        nxt = p + list(r1.tokens) + [1, 2]
        r = run(ex, nxt)
        assert r.usage.cached_tokens == 0 and ex.jobs.prefills[-1][1] == 0
        assert ex.prompt_cache_stats().misses == 3
    assert list(r.tokens) == reference_stream(runner, nxt, GREEDY)


def test_a_hit_whose_first_step_a_drain_fails_resumes_with_the_whole_prompt(runner):
    p = tokens(40, 21)
    with make("step") as ex:
        r1 = run(ex, p)
        nxt = p + list(r1.tokens) + [3, 4, 5]
        s = ex.generate(nxt, GREEDY)            # admitted and queued, not yet submitted
        assert ex.jobs.prefills[-1][1] > 0
        assert ex.recover("test: reset under a cache hit")
        drive(ex, lambda: s.done() and ex.idle())
        r = s.result(0)
        assert r.finish_reason is FinishReason.LENGTH and r.resumes == 1
        assert ex.jobs.prefills[-1][1:] == (0, len(nxt))
    assert list(r.tokens) == reference_stream(runner, nxt, GREEDY)


# ---- what is never cached, the budget, close --------------------------------------

def test_a_sequence_the_caller_opened_is_never_cached(mode):
    p = tokens(30, 2)
    with make(mode) as ex:
        with ex.open_sequence() as seq:
            s = seq.generate(p, GREEDY)
            drive(ex, lambda: s.done() and ex.idle())
        assert ex.prompt_cache_stats().stored == 0
        drive(ex, lambda: seq.state == SequenceState.RELEASED)
        r = run(ex, [*p, 1])
        assert r.usage.cached_tokens == 0
        assert ex.prompt_cache_stats().misses == 1


def test_the_budget_evicts_the_least_recently_used(mode):
    a, b, c = tokens(30, 1), tokens(30, 2), tokens(30, 3)
    with make(mode, cache=PromptCacheConfig(max_sequences=2, max_tokens=10_000)) as ex:
        ra = run(ex, a)
        run(ex, b)
        ra2 = run(ex, a + list(ra.tokens) + [5])   # a's sequence: used last now
        assert ra2.usage.cached_tokens > 0
        run(ex, c)                                 # over two: b goes
        stats = ex.prompt_cache_stats()
        assert (stats.sequences, stats.evictions["budget"]) == (2, 1)
        assert run(ex, [*b, 1]).usage.cached_tokens == 0         # b was evicted
        assert run(ex, [*c, 1]).usage.cached_tokens > 0


def test_the_token_budget_evicts_and_an_entry_over_it_is_not_kept(mode):
    with make(mode, cache=PromptCacheConfig(max_sequences=8, max_tokens=100)) as ex:
        run(ex, tokens(50, 1))                     # 57 tokens of KV
        run(ex, tokens(40, 2))                     # 47 more: over 100, the first goes
        stats = ex.prompt_cache_stats()
        assert (stats.sequences, stats.tokens, stats.evictions["budget"]) == (1, 47, 1)
        run(ex, tokens(120, 3))                    # alone over the budget
        stats = ex.prompt_cache_stats()
        assert (stats.sequences, stats.evictions["budget"]) == (0, 3)


def test_close_releases_every_cached_sequence(mode, device):
    ex = make(mode, device)
    streams = [ex.generate(tokens(25, 300 * i), GREEDY) for i in range(3)]
    drive(ex, lambda: all(s.done() for s in streams) and ex.idle()
          and ex.prompt_cache_stats().sequences == 3)
    seqs = [s.sequence for s in streams]
    assert all(ex.epoch.kv.sequence_length(s.seq_id) == 32 for s in seqs)
    ex.close()
    assert ex.prompt_cache_stats().sequences == 0
    assert all(s.state == SequenceState.RELEASED for s in seqs)
    assert all(ex.epoch.kv.sequence_length(s.seq_id) == 0 for s in seqs)
    if device == "sim":                            # the device holds nothing either
        assert all(ex.driver.kv_allocated(s.seq_id) == 0 for s in seqs)


# ---- configuration and metrics ----------------------------------------------------

@pytest.mark.parametrize(("kw", "field"), [
    ({"max_sequences": 0, "max_tokens": 10}, "max_sequences"),
    ({"max_sequences": 2, "max_tokens": 0}, "max_tokens"),
    ({"max_sequences": True, "max_tokens": 10}, "max_sequences"),
    ({"max_sequences": 2, "max_tokens": 1.5}, "max_tokens"),
])
def test_a_bad_budget_is_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidArgument, match=rf"PromptCacheConfig\.{field}"):
        PromptCacheConfig(**kw)


def test_prompt_cache_must_be_a_config_or_none():
    with pytest.raises(InvalidArgument, match=r"ExecutorConfig\.prompt_cache"):
        ExecutorConfig(prompt_cache=(4, 100))
    assert ExecutorConfig().prompt_cache is None


def test_off_by_default_every_sequence_is_released():
    with make("step", cache=None) as ex:
        s = ex.generate(tokens(20, 1), GREEDY)
        drive(ex, ended_and_released(s))
        assert ex.prompt_cache_stats() is None
        assert ex.epoch.kv.sequences() == ()


def test_metrics_count_hits_misses_reused_tokens_and_evictions():
    from calfsm.telemetry.metrics import ExecutorMetrics

    with make("step", cache=PromptCacheConfig(max_sequences=1, max_tokens=1000)) as ex:
        m = ExecutorMetrics(ex)
        r = run(ex, tokens(30, 1))
        run(ex, tokens(30, 1) + list(r.tokens) + [9])
        run(ex, tokens(30, 2))                      # a miss; one sequence: evicts
        v = m.registry.get_sample_value
        assert v("calfsm_prompt_cache_hits_total") == 1
        assert v("calfsm_prompt_cache_misses_total") == 2
        assert v("calfsm_prompt_cache_reused_tokens_total") == 37
        assert v("calfsm_prompt_cache_evictions_total", {"cause": "budget"}) == 1
        assert v("calfsm_prompt_cache_evictions_total", {"cause": "reset"}) == 0
        assert v("calfsm_prompt_cache_sequences") == 1
        assert v("calfsm_prompt_cache_tokens") == 37
        m.close()
    with make("step", cache=None) as ex:
        m = ExecutorMetrics(ex)
        assert m.registry.get_sample_value("calfsm_prompt_cache_hits_total") is None
        m.close()


# ---- the server ---------------------------------------------------------------------

def test_a_chats_second_turn_through_the_server_reuses_the_first_turns_kv():
    """A chat client resends the history: the second turn's usage says how many prompt
    tokens came from the cache, and its answer is a fresh run's."""
    import httpx

    from calfsm.serve import ByteTokenizer, realtime_sim
    from calfsm.serve.tokenizer import chat_prompt
    from tests.helpers.serve import reference, serve

    tok = ByteTokenizer(VOCAB)
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.2, prefill_token_us=1), TINY,
                        ExecutorConfig(max_sequences=8, prompt_cache=BIG))
    srv = serve(ex)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            said = [("system", "be brief"), ("user", "hello there")]
            body = {"model": "tiny", "max_tokens": 12, "temperature": 0}
            first = client.post("/v1/chat/completions", json=body | {
                "messages": [{"role": r, "content": c} for r, c in said]}).json()
            answer = first["choices"][0]["message"]["content"]
            assert "prompt_tokens_details" not in first["usage"]
            said += [("assistant", answer), ("user", "and now?")]
            second = client.post("/v1/chat/completions", json=body | {
                "messages": [{"role": r, "content": c} for r, c in said]}).json()
        prompt = tok.encode(chat_prompt(said))
        assert second["usage"]["prompt_tokens"] == len(prompt)
        first_prompt = tok.encode(chat_prompt(said[:2]))
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] \
            >= len(first_prompt)
        assert tok.encode(second["choices"][0]["message"]["content"]) == reference(
            prompt, SamplingParams(max_tokens=12))
        assert ex.prompt_cache_stats().hits == 1
    finally:
        srv.stop()
        ex.close()
