"""What a generation stream yields and ends with: the records its consumer and its
observers read (kept apart from :mod:`calfsm.generate.stream` so observers, low in the layers,
can name them)."""

from __future__ import annotations

import enum

import attrs

from calfsm.engine.job import JobTimings
from calfsm.errors import CalfsmError

__all__ = ["FinishReason", "GenerationResult", "TokenEvent", "Usage"]


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


@attrs.frozen
class TokenEvent:
    """One generated token: its id, its position in the sequence, its index in the
    stream, the timings of the job that produced it, and on an executor with a
    tokenizer the ``text`` it delivers (maybe ``""``: a character it begins comes with
    a later token; before a stop string only its text up to it); None without one. With
    ``SamplingParams(logprobs=k)``: its log-probability and the ``k`` most likely tokens
    as ``(token, logprob)``, most likely first (ties by token id), both of the row the
    sampler saw (after the logits processors, before temperature, top-k and top-p)."""

    token: int
    position: int
    index: int
    timings: JobTimings = attrs.field(repr=False)
    text: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens whose KV was reused from the prompt cache (not prefilled again)
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class GenerationResult:
    """A finished stream: tokens, why it ended, usage, time to first token and the
    inter-token times (seconds, on the driver's clock). ``text`` (on an executor with a
    tokenizer, else None): all the text delivered, the events' texts joined, then what
    the decoder still held at the end (bytes that never completed a character)."""

    tokens: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    ttft_s: float | None
    inter_token_s: tuple[float, ...]
    error: CalfsmError | None = None
    resumes: int = 0
    text: str | None = None
