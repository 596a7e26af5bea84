"""Shared helpers for stream tests: when a one-shot stream is over (it ended and its
sequence was released), and the direct path's golden tokens the streams must equal."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from calfsm.drivers.sim import SimDriver
from calfsm.executor import DeviceExecutor
from calfsm.generate.streams import GenerationResult, Stream
from calfsm.machines.sequence import SequenceState
from calfsm.tools.direct import DirectRunner
from tests.helpers.executor import TINY, drive


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
