"""The request of one inference job: what the caller asks the device to compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from calfsm.drivers.base import EngineSlot
from calfsm.manifest import TaskKind

__all__ = ["Request"]


_I64 = np.dtype(np.int64)


def _int_array(values: Any) -> np.ndarray | None:
    if values is None:
        return None
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype == _I64:
        return values                   # already what we keep (a decode builds this)
    return np.asarray(values, dtype=np.int64).reshape(-1)


@attrs.frozen
class Request:
    """One inference job: a prefill of ``tokens`` or a one-token decode, for one sequence.

    ``positions`` default to ``past_len, past_len+1, ...``; ``past_len`` defaults to the
    first position. ``deadline_s`` bounds the whole job from enqueue (the executor's
    admission/queue/execution timeouts apply inside it). ``target``, when given, is the
    caller's float32 array (at least ``vocab`` long) the logits are written into — no
    copy, no temporary of the vocabulary.
    """

    seq_id: int
    kind: TaskKind
    tokens: Any = attrs.field(default=None, converter=_int_array)
    positions: Any = attrs.field(default=None, converter=_int_array)
    past_len: int | None = None
    deadline_s: float | None = None
    target: np.ndarray | None = attrs.field(default=None, eq=False)
    seq_count: int = 1
    engine: EngineSlot = EngineSlot.AUTO

    @classmethod
    def prefill(cls, seq_id: int, tokens: Sequence[int], *, past_len: int = 0,
                **kw: Any) -> Request:
        n = len(tokens)
        return cls(seq_id, TaskKind.PREFILL_IDS, tokens,
                   np.arange(past_len, past_len + n), past_len=past_len, **kw)

    @classmethod
    def decode(cls, seq_id: int, token: int, position: int, **kw: Any) -> Request:
        return cls(seq_id, TaskKind.DECODE, np.array((token,), _I64),
                   np.array((position,), _I64), past_len=position, **kw)
