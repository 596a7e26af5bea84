"""The llama.cpp-shaped entry: ``llama_batch`` in, llama.cpp's return codes out.

For code written against llama.cpp's scheduling interface (``llama_decode``, its
batches, ``llama_get_logits_ith`` and the memory operations)::

    from calfsm.llama import LlamaBatch, LlamaContext

    with LlamaContext(executor) as ctx:
        batch = LlamaBatch.get_one(prompt)
        for _ in range(n_predict):
            if ctx.decode(batch) != 0:          # 1 retry, 2 aborted, < 0 error
                break
            token = int(ctx.get_logits_ith(-1).argmax())
            batch = LlamaBatch.get_one([token])

- :mod:`~calfsm.llama.batch`: :class:`LlamaBatch` and its check (one sequence, or
  several on a batch calbin);
- :mod:`~calfsm.llama.context`: :class:`LlamaContext` (``decode``, ``decode_sync``,
  the logits), :func:`decode`, :func:`decode_sync`;
- :mod:`~calfsm.llama.codes`: the one table from calfsm's errors to the return codes;
- :mod:`~calfsm.llama.memory`: the KV-cache adapter, only what calfsm really does;
- :mod:`~calfsm.llama.sampling`: :class:`SamplerChain`, the sampler chain (logits
  processors, then greedy or a seeded draw) on ``get_logits_ith``.

``docs/llama.md`` describes the mapping and what is not supported.
"""

from calfsm.llama.batch import LlamaBatch
from calfsm.llama.codes import (
    ABORTED,
    DEVICE_FAILED,
    EXECUTOR_UNUSABLE,
    INVALID_INPUT,
    NO_KV_SLOT,
    RETURN_CODES,
    SUCCESS,
    return_code,
)
from calfsm.llama.context import DecodeResult, LlamaContext, decode, decode_sync
from calfsm.llama.memory import KV_OPERATIONS, LlamaMemory
from calfsm.llama.sampling import SamplerChain

__all__ = [
    "ABORTED",
    "DEVICE_FAILED",
    "EXECUTOR_UNUSABLE",
    "INVALID_INPUT",
    "KV_OPERATIONS",
    "NO_KV_SLOT",
    "RETURN_CODES",
    "SUCCESS",
    "DecodeResult",
    "LlamaBatch",
    "LlamaContext",
    "LlamaMemory",
    "SamplerChain",
    "decode",
    "decode_sync",
    "return_code",
]
