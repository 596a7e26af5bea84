"""Logits processors: callables that change a logits row in place before a token is
chosen from it (``SamplingParams(logits_processors=[...])``).

A processor is ``fn(tokens, row) -> None``: ``tokens`` the stream's tokens so far (the
prompt, then what it generated; a read-only sequence, valid during the call) and
``row`` the float32 logits of the vocabulary, writeable and contiguous, which it
changes in place. Processors run in order on the completion thread, before logprobs are
taken and before the token is chosen, so they must be quick and must not block.

The two built in here touch only their own tokens (an index add, an index assign): no
temporary of the vocabulary's size. :func:`logit_bias` adds a bias to some tokens'
logits (OpenAI's ``logit_bias``); :func:`ban_tokens` sets some to ``-inf``, so neither
greedy nor a draw can choose them. Both are values (equal when their tokens and biases
are) and know their token ids, which the sampler checks against the vocabulary.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from calfsm.errors import InvalidArgument

__all__ = ["BanTokens", "LogitBias", "TokenHistory", "ban_tokens", "logit_bias"]


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message, stage="request")


def token_id(value: Any, where: str, *, field: str | None = None) -> int:
    """``value`` as a token id (an integer >= 0, numpy's too, not a bool), else an
    InvalidArgument naming ``where`` (sampling's checks share it; ``field``: the argument
    it belongs to, the error's ``field``)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise InvalidArgument(f"{where} must be a token id (an integer >= 0), got "
                              f"{reprlib.repr(value)}", stage="request", field=field)
    return int(value)


@attrs.frozen
class LogitBias:
    """Adds ``bias`` to the logit of each of its tokens (see :func:`logit_bias`)."""

    biases: tuple[tuple[int, float], ...]
    _ids: np.ndarray = attrs.field(init=False, repr=False, eq=False)
    _values: np.ndarray = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_ids", np.array([t for t, _ in self.biases], np.intp))
        object.__setattr__(self, "_values",
                           np.array([b for _, b in self.biases], np.float32))

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for t, _ in self.biases)

    def __call__(self, tokens: Sequence[int], row: np.ndarray) -> None:
        row[self._ids] += self._values


@attrs.frozen
class BanTokens:
    """Sets the logit of each of its tokens to ``-inf`` (see :func:`ban_tokens`)."""

    token_ids: tuple[int, ...]
    _ids: np.ndarray = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_ids", np.array(self.token_ids, np.intp))

    def __call__(self, tokens: Sequence[int], row: np.ndarray) -> None:
        row[self._ids] = -np.inf


_F32_MAX = float(np.finfo(np.float32).max)


def _finite_f32(value: Any) -> bool:
    """Whether ``value`` is finite as the float32 it is added as (an int beyond the
    floats, or 1e39, is not: it would make the row's logit infinite)."""
    try:
        return abs(float(value)) <= _F32_MAX
    except OverflowError:
        return False


def logit_bias(biases: Mapping[int, float]) -> LogitBias:
    """A processor adding ``biases[token]`` to each named token's logit (a finite
    number; a large negative one makes a token unlikely, :func:`ban_tokens` makes it
    impossible). Bad input raises InvalidArgument naming the entry."""
    if not isinstance(biases, Mapping):
        raise _bad(f"logit_bias takes a mapping of token id -> bias, got "
                   f"{reprlib.repr(biases)}")
    out = []
    for t, b in biases.items():
        tok = token_id(t, "logit_bias key")
        if isinstance(b, bool) or not isinstance(b, int | float | np.integer | np.floating) \
                or not _finite_f32(b):
            raise _bad(f"logit_bias[{tok}] must be a finite number (as a float32), got "
                       f"{reprlib.repr(b)}")
        out.append((tok, float(np.float32(b))))
    return LogitBias(tuple(sorted(out)))


def ban_tokens(ids: Iterable[int]) -> BanTokens:
    """A processor that makes each of ``ids`` impossible (its logit ``-inf``). A row
    whose every token is banned is an InvalidArgument when a token is chosen."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise _bad(f"ban_tokens takes token ids, got {reprlib.repr(ids)}")
    return BanTokens(tuple(sorted({token_id(t, "ban_tokens id") for t in ids})))


class TokenHistory(Sequence[int]):
    """The first ``n`` tokens of ``prompt`` then ``generated``, read in place (what a
    processor gets as ``tokens``: no copy of the history per token)."""

    __slots__ = ("_generated", "_n", "_prompt")

    def __init__(self, prompt: Sequence[int], generated: Sequence[int],
                 n: int | None = None) -> None:
        self._prompt = prompt
        self._generated = generated
        total = len(prompt) + len(generated)
        self._n = total if n is None else min(n, total)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self._n)))
        n = self._n
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token history index out of range")
        p = len(self._prompt)
        return self._prompt[i] if i < p else self._generated[i - p]

    def __repr__(self) -> str:
        return f"TokenHistory({list(self)!r})"
