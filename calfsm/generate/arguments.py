"""A generation's arguments, judged before anything is taken for it: one rule for the
library and the server.

Theory of operation
-------------------
What a generation asks for can often be judged against the model alone: how many
streams (``n``), the prompt's token ids and length, and ``max_tokens``. A request that
fails such a check can never succeed as sent, so it is refused at once with an
:class:`~calfsm.errors.InvalidArgument` (HTTP 400, not retryable) — never a retryable 429,
never a stream that ends in an error later — and before a sequence, a buffer or KV is
taken for it. The checks cost O(1) memory beyond the prompt itself: ``n`` is judged
before anything of size ``n`` is built.

The rules (the library's :meth:`DeviceExecutor.generate
<calfsm.executor.DeviceExecutor.generate>`, :meth:`Sequence.generate
<calfsm.generate.sequence.Sequence.generate>` and :class:`~calfsm.llama.LlamaContext` call them, and
the server's :mod:`calfsm.serve.protocol` calls the same functions, answering 400 with the
field as ``param``):

- ``n`` (streams started at once, each on a sequence of its own): an integer in
  ``1..min(MAX_N, sequences)``, ``sequences`` being those the executor opens at once
  (``ExecutorConfig.max_sequences``);
- the prompt: at least one token, every id in ``[0, vocab)``, at most what one prefill
  job carries, and leaving at least one position of the context after the sequence's
  ``position``;
- ``max_tokens``: at most the context left after the prompt, ``position + len(prompt) +
  max_tokens <= max_seq`` (as OpenAI answers). A stream given no parameters gets the
  default ``max_tokens`` clipped to that room (:func:`default_params`).
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from calfsm.errors import InvalidArgument
from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import SubmodelContract, TaskKind

__all__ = ["MAX_N", "ContextLimits", "check_max_tokens", "check_n", "check_prompt",
           "check_token_ids", "context_left", "default_params"]

#: the most streams one call starts at once (``generate(n=...)``, a server request's
#: choices, a llama context's sequences), whatever ``max_sequences`` says: one call may
#: not make a million of anything
MAX_N = 1024


class _Model(Protocol):
    def submodel(self, kind: TaskKind) -> SubmodelContract: ...


@attrs.frozen
class ContextLimits:
    """What a generation is judged against: the vocabulary, the context (``max_seq``,
    prompt and generated tokens together) and the most prompt tokens one prefill job
    carries (``max_prompt``)."""

    vocab: int
    max_seq: int
    max_prompt: int

    @classmethod
    def of(cls, model: _Model) -> ContextLimits:
        """The limits of a manifest or a configured model (its decode and prefill
        sub-models)."""
        decode = model.submodel(TaskKind.DECODE)
        prefill = model.submodel(TaskKind.PREFILL_IDS)
        return cls(decode.vocab, decode.max_seq, min(prefill.max_tokens, prefill.max_seq))


def _bad(message: str, **ctx: Any) -> InvalidArgument:
    return InvalidArgument(message, stage="request", **ctx)


def check_n(n: Any, sequences: int, *, field: str = "n") -> int:
    """``n`` streams at once: an integer in ``1..min(MAX_N, sequences)`` (more could
    never be served together: each needs a sequence of its own). O(1)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise _bad(f"{field} must be an integer >= 1, got {reprlib.repr(n)}")
    if n > MAX_N:
        raise _bad(f"{field} = {reprlib.repr(n)}: one call opens at most {MAX_N} "
                   "sequences at once")
    if n > sequences:
        raise _bad(f"{field} = {n} needs {n} sequences at once; this executor opens at "
                   f"most {sequences} (ExecutorConfig.max_sequences)")
    return n


def check_token_ids(tokens: np.ndarray | Sequence[int], vocab: int, *,
                    field: str = "prompt") -> None:
    """Every id of ``tokens`` (integers) in ``[0, vocab)``; the first one that is not
    is named by its index."""
    if isinstance(tokens, np.ndarray):
        if not tokens.size or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab):
            return
        i = int(np.flatnonzero((tokens < 0) | (tokens >= vocab))[0])
        bad: Any = tokens.item(i)
    else:
        i = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
        if i is None:
            return
        bad = tokens[i]
    raise _bad(f"{field}[{i}] must be a token id in [0, {vocab}), got "
               f"{reprlib.repr(bad)}")


def context_left(prompt_tokens: int, limits: ContextLimits, *, position: int = 0,
                 field: str = "prompt") -> int:
    """Tokens the context leaves to generate after a prompt of ``prompt_tokens`` placed
    at ``position``: at least one, else InvalidArgument (as a prompt of no token, or one
    longer than a prefill job carries)."""
    if prompt_tokens < 1:
        raise _bad(f"{field} must hold at least one token")
    if prompt_tokens > limits.max_prompt:
        raise _bad(f"{field} of {prompt_tokens} tokens: one prefill carries at most "
                   f"{limits.max_prompt}")
    room = limits.max_seq - position - prompt_tokens
    if room < 1:
        at = f" after position {position}" if position else ""
        raise _bad(f"{field} of {prompt_tokens} tokens{at} leaves no room to generate "
                   f"(the model holds {limits.max_seq})")
    return room


def check_prompt(tokens: np.ndarray | Sequence[int], limits: ContextLimits, *,
                 position: int = 0, field: str = "prompt") -> int:
    """A prompt (integer ids) at ``position``: its length, then its ids. Returns the
    room it leaves (:func:`context_left`)."""
    room = context_left(len(tokens), limits, position=position, field=field)
    check_token_ids(tokens, limits.vocab, field=field)
    return room


def check_max_tokens(max_tokens: int, prompt_tokens: int, limits: ContextLimits, *,
                     position: int = 0, field: str = "max_tokens") -> None:
    """``max_tokens`` within the context left after the prompt (as OpenAI answers)."""
    room = limits.max_seq - position - prompt_tokens
    if max_tokens > room:
        at = f" at position {position}" if position else ""
        raise _bad(f"this model's context holds {limits.max_seq} tokens: a prompt of "
                   f"{prompt_tokens}{at} leaves room for {max(room, 0)}, but {field} "
                   f"asks for {reprlib.repr(max_tokens)}")


def default_params(room: int) -> SamplingParams:
    """The parameters of a stream given none: the default ``max_tokens`` clipped to the
    ``room`` the context leaves (as the server's default is)."""
    default = SamplingParams()
    return default if default.max_tokens <= room else SamplingParams(max_tokens=room)
