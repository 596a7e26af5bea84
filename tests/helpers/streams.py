"""Shared helpers for stream tests: when a one-shot stream is over (it ended and its
sequence was released), that everything it held came back, running many streams a few
at a time, and the direct path's golden tokens the streams must equal."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from calfsm.drivers.sim import SimDriver
from calfsm.executor import DeviceExecutor
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import GenerationResult, Stream
from calfsm.machines.sequence import SequenceState
from calfsm.runtime.stepper import StepScheduler
from calfsm.tools.direct import DirectRunner, golden_prompts
from tests.helpers.executor import TINY, drive

N_TOKENS = 16
PROMPTS = golden_prompts()
PROMPT = PROMPTS[5]                  # 127 tokens
GREEDY = SamplingParams(max_tokens=N_TOKENS)


def settled(stream: Stream) -> Callable[[], bool]:
    """A predicate: ``stream`` ended and its one-shot sequence was released (a stream's
    end is announced before the sequence's deferred release runs)."""
    return lambda: stream.done() and stream.sequence.state == SequenceState.RELEASED


def settle(ex: DeviceExecutor, stream: Stream, seed: int = 0) -> GenerationResult:
    """Drive until ``stream`` ended and its one-shot sequence was released."""
    drive(ex, settled(stream), seed=seed)
    return stream.result(0)


def direct_runner(manifest: Any = TINY) -> DirectRunner:
    """The direct synchronous path on its own simulated device: the reference."""
    return DirectRunner(SimDriver(manifest, trace=False), manifest)


@functools.cache
def _golden(prompts: tuple[tuple[int, ...], ...], n_tokens: int,
            seq_per_prompt: bool) -> tuple[tuple[int, ...], ...]:
    runner = direct_runner()
    return tuple(tuple(runner.generate(i if seq_per_prompt else 0, p, n_tokens))
                 for i, p in enumerate(prompts))


def golden_tokens(prompts: Iterable[Iterable[int]], n_tokens: int, *,
                  seq_per_prompt: bool = False) -> list[list[int]]:
    """The greedy tokens of the direct path on TINY for each prompt (on sequence 0, or on
    sequence i for prompt i): what a stream of the same prompt must give. Computed once
    per process for the same arguments (several test modules ask for the same 100
    prompts); each call returns lists of its own."""
    key = tuple(tuple(p) for p in prompts)
    return [list(t) for t in _golden(key, n_tokens, seq_per_prompt)]


def reference_fixtures(prompts: Iterable[Iterable[int]], n_tokens: int
                       ) -> tuple[Any, Any]:
    """A module-scoped ``golden`` (:func:`golden_tokens` of ``prompts``) and a ``device``
    (each test on the simulated device, then the native emulator) fixture, for a test
    module whose streams must equal the reference on both to bind:
    ``golden, device = reference_fixtures(PROMPTS, N_TOKENS)``."""

    @pytest.fixture(scope="module")
    def golden() -> list[list[int]]:
        return golden_tokens(prompts, n_tokens)

    @pytest.fixture(params=["sim", "emulator"])
    def device(request: pytest.FixtureRequest) -> str:
        return request.param

    return golden, device


def assert_freed(ex: DeviceExecutor) -> None:
    """No lease, no open or waiting KV reservation, no sequence holding KV, the books
    balanced, nothing queued or on the device. (Threaded: the completion side may still
    be finishing the last job when its stream ends; a leak never settles.)"""
    epoch = ex.epoch

    def quiet() -> bool:
        kv = epoch.kv.stats()
        return (ex.idle() and epoch.pool.stats().leased == 0
                and kv.open == ex.stats().admitting == 0)

    drive(ex, quiet, timeout=10)
    kv = epoch.kv.stats()
    assert epoch.pool.stats().leased == 0, epoch.pool.stats()
    assert kv.open == ex.stats().admitting == kv.budget_used == 0, kv
    assert kv.reserved == kv.committed + kv.rolled_back + kv.unknown, kv
    assert epoch.kv.sequences() == (), epoch.kv.sequences()
    assert ex.idle()
    assert ex.lifecycle_state == "Ready"


def assert_id_reused(ex: DeviceExecutor, seq_id: int) -> None:
    """The lowest free id comes back, with no KV."""
    with ex.open_sequence() as seq:
        assert seq.seq_id == seq_id and seq.position == 0
        assert ex.epoch.kv.sequence_length(seq_id) == 0


def run_streams(ex: DeviceExecutor, prompts: list[list[int]], params: SamplingParams, *,
                lanes: int, seed: int = 0) -> dict[int, tuple[GenerationResult, list]]:
    """Generate every prompt, ``lanes`` streams at a time; each result with the events
    its consumer read."""
    todo = list(enumerate(prompts))
    live: dict[int, Stream] = {}
    out: dict[int, tuple[GenerationResult, list]] = {}
    sched = None if ex.config.threaded else StepScheduler(ex, seed)
    while todo or live:
        while todo and len(live) < lanes:
            i, prompt = todo.pop(0)
            live[i] = ex.generate(prompt, params)
        if sched is None:
            next(iter(live.values())).result(30)
        else:
            sched.run_until(lambda: any(s.done() for s in live.values()))
        for i, s in list(live.items()):
            if s.done():
                out[i] = (s.result(0), list(s))
                del live[i]
    drive(ex, ex.idle, seed=seed)
    return out
