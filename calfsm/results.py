"""What a generation stream yields and ends with: the records its consumer and its
observers read (kept apart from :mod:`calfsm.streams` so observers, low in the layers,
can name them)."""

from __future__ import annotations

import enum

import attrs

from calfsm.errors import CalfsmError
from calfsm.job import JobTimings

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
    stream, and the timings of the job that produced it."""

    token: int
    position: int
    index: int
    timings: JobTimings = attrs.field(repr=False)


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
    inter-token times (seconds, on the driver's clock)."""

    tokens: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    ttft_s: float | None
    inter_token_s: tuple[float, ...]
    error: CalfsmError | None = None
    resumes: int = 0
