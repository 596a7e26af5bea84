"""Repetition, frequency and presence penalties, and ``min_tokens``: one stream's
changes to its logits row that depend on what it has seen.

Theory of operation
-------------------
The definitions are vLLM's (``apply_penalties``), in float32 on the row as it is after
the stream's logits processors, in this order:

1. ``repetition_penalty`` ``r`` on every token seen in the prompt *or* the output: a
   positive logit ``x`` becomes ``x / r``, any other ``x * r``;
2. ``frequency_penalty`` ``f`` on every token of the output: ``x - f * count`` (the
   times it was generated, as float32);
3. ``presence_penalty`` ``p`` on every token of the output: ``x - p``;
4. ``min_tokens`` ``m``: while fewer than ``m`` tokens were generated, the stop tokens
   (``stop_token_ids``, one-token stop sequences, and the end-of-sequence token, even
   with ``ignore_eos``) are set to ``-inf``, as vLLM's ``MinTokensLogitsProcessor``
   masks them.

"Output" is what the stream generated (after the first ``prompt_len`` tokens of the
history the sampler is given), so the frequency and presence penalties ignore the
prompt, as vLLM's do; the repetition penalty reads both.

Cost: only the distinct ids seen are touched (one index gather and scatter of them per
penalty), so no temporary of the vocabulary's size is made. The prompt's distinct ids are
found once; the output is counted incrementally (one dict update per token), and only
when a penalty reads the counts (``min_tokens`` alone reads the history's length). A
history shorter than what was counted (a resumed stream replays its last token with the
tokens before it) is counted again from the prompt, so every token counts exactly once
for the row it precedes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Penalties"]

_F32 = np.dtype(np.float32)


def _room(a: np.ndarray, n: int) -> np.ndarray:
    """``a``, or a longer copy of it when its ``n`` values fill it."""
    return a if n < a.shape[0] else np.resize(a, max(2 * n, 16))


class Penalties:
    """The state of one stream's penalties and ``min_tokens`` mask (see the module).
    Not shared between streams or threads."""

    __slots__ = ("_counted", "_counts", "_freq", "_ids", "_mask", "_min", "_n", "_pres",
                 "_prompt", "_prompt_len", "_reads", "_rep", "_seen", "_seen_n", "_slot")

    def __init__(self, *, repetition: float, frequency: float, presence: float,
                 min_tokens: int, stop_ids: Sequence[int], prompt_len: int) -> None:
        self._rep = np.float32(repetition) if repetition != 1.0 else None
        self._freq = np.float32(frequency) if frequency else None
        self._pres = np.float32(presence) if presence else None
        #: a penalty reads the tokens (else only ``min_tokens``, which reads their number)
        self._reads = not (self._rep is None and self._freq is None and self._pres is None)
        self._min = min_tokens
        self._mask = np.array(sorted(set(stop_ids)), np.intp)
        self._prompt_len = prompt_len
        self._prompt: frozenset[int] | None = None
        #: the repetition penalty's ids: the prompt's distinct ids, then the output's
        #: that are not in the prompt (the first ``_seen_n``)
        self._seen = np.empty(0, np.intp)
        self._seen_n = 0
        self._reset()

    def _reset(self) -> None:
        #: the output counted so far: history length, id -> slot, ids, counts (float32,
        #: as the frequency penalty reads them)
        self._counted = self._prompt_len
        self._slot: dict[int, int] = {}
        self._ids = np.empty(16, np.intp)
        self._counts = np.empty(16, _F32)
        self._n = 0
        if self._prompt is not None:
            self._seen_n = len(self._prompt)

    def _count(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        p = self._prompt_len
        if self._prompt is None:
            self._prompt = frozenset(int(t) for t in tokens[:p]) if p else frozenset()
            self._seen = np.array(sorted(self._prompt), np.intp)
            self._seen_n = len(self._prompt)
        if n < self._counted:
            self._reset()           # a replay: the tokens before the replayed one
        slot, prompt = self._slot, self._prompt
        for i in range(max(self._counted, p), n):
            t = int(tokens[i])
            j = slot.get(t)
            if j is None:
                j = slot[t] = self._n
                self._ids = _room(self._ids, j)
                self._counts = _room(self._counts, j)
                self._ids[j] = t
                self._counts[j] = 0
                self._n += 1
                if t not in prompt:
                    self._seen = _room(self._seen, self._seen_n)
                    self._seen[self._seen_n] = t
                    self._seen_n += 1
            self._counts[j] += 1
        self._counted = max(n, p)

    def output_len(self, tokens: Sequence[int]) -> int:
        """The tokens generated so far in ``tokens`` (the history)."""
        return max(0, len(tokens) - self._prompt_len)

    def native_args(self, tokens: Sequence[int]) -> tuple[float, float, float, np.ndarray | None,
                                                          np.ndarray | None,
                                                          np.ndarray | None,
                                                          np.ndarray | None]:
        """What :meth:`apply` would do for the token after ``tokens``, for the native
        tail (calfsm/engine/tail.py) to do: ``(repetition, frequency, presence, seen ids,
        output ids, their counts, banned ids)``, the factors as float32 values (1, 0, 0:
        off) and None for an array with nothing to do. The arrays are views of this
        state: valid until the next call."""
        if self._reads:
            self._count(tokens)
        rep = self._rep
        seen = self._seen[:self._seen_n] if rep is not None and self._seen_n else None
        n = self._n
        moves = n and (self._freq is not None or self._pres is not None)
        banned = self._mask if self._min and self._mask.shape[0] \
            and self.output_len(tokens) < self._min else None
        return (float(rep) if rep is not None else 1.0,
                float(self._freq) if self._freq is not None else 0.0,
                float(self._pres) if self._pres is not None else 0.0,
                seen, self._ids[:n] if moves else None,
                self._counts[:n] if moves else None, banned)

    def apply(self, row: np.ndarray, tokens: Sequence[int]) -> None:
        """Change ``row`` (float32, the vocabulary) in place for the token after
        ``tokens`` (the prompt, then the output)."""
        if self._reads:
            self._count(tokens)
        rep = self._rep
        if rep is not None and self._seen_n:
            ids = self._seen[:self._seen_n]
            x = row[ids]
            row[ids] = np.where(x > 0, x / rep, x * rep)
        n = self._n
        if n and (self._freq is not None or self._pres is not None):
            ids = self._ids[:n]
            x = row[ids]
            if self._freq is not None:
                x -= self._freq * self._counts[:n]
            if self._pres is not None:
                x -= self._pres
            row[ids] = x
        if self._min and self._mask.shape[0] and self.output_len(tokens) < self._min:
            row[self._mask] = -np.inf
