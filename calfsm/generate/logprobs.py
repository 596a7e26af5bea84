"""Log-probabilities of a logits row: ``log_softmax`` in float64 and the top-k tokens,
in fixed-size chunks (no temporary of the vocabulary's size).

:class:`RowLogprobs` reads a float32 row once: its maximum ``m`` and ``log Z = m +
log(sum(exp(x - m)))`` accumulated in float64 chunk by chunk (each chunk's ``exp`` in
float64, the running sum rescaled when a later chunk holds a larger maximum), so
``logprob(t) = x[t] - log Z`` is within about 1e-12 of a float64 ``log_softmax`` of the
whole row. The top-k are found from the chunks' maxima: the k-th largest of them is at
most the row's k-th largest logit, so only the logits at or above it are candidates, and
each chunk keeps at most k of them. Ties are ordered by token id; tokens at ``-inf``
(banned) are never listed. A row whose maximum is ``-inf`` (every token banned) raises
InvalidArgument, one with a NaN or ``+inf`` raises Internal (category PROGRAMMING: only
a logits processor can leave one; the pipeline checks the device's rows).
"""

from __future__ import annotations

import math

import numpy as np

from calfsm.errors import ErrorCategory, Internal, InvalidArgument

__all__ = ["MAX_LOGPROBS", "RowLogprobs"]

#: the most alternatives a token event carries (OpenAI's chat limit, vLLM's default)
MAX_LOGPROBS = 20
_CHUNK = 4096
_F64 = np.dtype(np.float64)
_STAGE = "sample"


def unusable_row(m: float) -> InvalidArgument | Internal:
    """The error for a row whose maximum ``m`` is not finite."""
    if m == -math.inf:
        return InvalidArgument("every token's logit is -inf after the logits processors: "
                               "no token can be chosen", stage=_STAGE)
    return Internal(f"the logits row's maximum is {m} after the logits processors "
                    "(a processor must leave the row finite or -inf)",
                    category=ErrorCategory.PROGRAMMING, stage=_STAGE)


class RowLogprobs:
    """``log_softmax`` of one float32 row: :attr:`log_z`, :meth:`of` a logit,
    :meth:`top` k tokens, and the row's :attr:`argmax` (lowest id of the maximum: what
    greedy takes, found in the same pass). Reads the row when made; keeps only the
    chunks' maxima."""

    __slots__ = ("_maxima", "argmax", "log_z", "max_logit")

    def __init__(self, x: np.ndarray) -> None:
        n = x.shape[0]
        maxima = []
        m, s, at = -math.inf, 0.0, 0
        for lo in range(0, n, _CHUNK):
            c = x[lo:lo + _CHUNK]
            i = int(c.argmax())                 # a NaN's index if there is one
            cm = float(c[i])
            maxima.append(cm)
            if not cm < math.inf:               # NaN or +inf
                raise unusable_row(cm)
            if cm == -math.inf:
                continue
            if cm > m:                          # strict: a tie keeps the lower id
                s *= math.exp(m - cm)           # 0 while nothing was summed
                m, at = cm, lo + i
            d = c.astype(_F64)
            d -= m
            np.exp(d, out=d)
            s += float(d.sum())
        if m == -math.inf:
            raise unusable_row(m)
        self.max_logit = m
        self.argmax = at
        self.log_z = m + math.log(s)
        self._maxima = maxima

    def of(self, logit: float) -> float:
        """The log-probability of a token whose logit (in this row) is ``logit``."""
        return float(logit) - self.log_z

    def top(self, x: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
        """The ``k`` most likely tokens of ``x`` (the row this was made from) with their
        log-probabilities, most likely first, ties by token id."""
        if k <= 0:
            return ()
        maxima = self._maxima
        t0 = sorted(maxima)[-k] if len(maxima) >= k else -math.inf
        ids, vals = [], []
        for j, cm in enumerate(maxima):
            if cm < t0 or cm == -math.inf:
                continue
            lo = j * _CHUNK
            c = x[lo:lo + _CHUNK]
            idx = np.flatnonzero(c >= t0) if t0 > -math.inf else np.flatnonzero(c > t0)
            v = c[idx]
            if idx.shape[0] > k:
                keep = np.lexsort((idx, -v))[:k]
                idx, v = idx[keep], v[keep]
            ids.append(idx + lo)
            vals.append(v)
        all_ids, all_vals = np.concatenate(ids), np.concatenate(vals)
        order = np.lexsort((all_ids, -all_vals))[:k]
        log_z = self.log_z
        # by the float64 log-probability itself (two float32 logits may round to one)
        return tuple(sorted(((int(all_ids[i]), float(all_vals[i]) - log_z) for i in order),
                            key=lambda e: (-e[1], e[0])))
