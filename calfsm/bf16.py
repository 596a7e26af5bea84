"""numpy's bfloat16 dtype, imported on first use.

numpy has no bfloat16; ml_dtypes provides it, and importing ml_dtypes costs ~0.6 s (its
extension registers every dtype it has), several times the rest of ``import calfsm``.
An embedder pays the import at every process start, so no module imports ml_dtypes at
its top: each takes the dtype from :func:`bf16_dtype` where it first needs it (a buffer
slot's view of its logits, the logits module's first plan, a request's embeddings check)
and binds it there once, so the per-token path reads a bound name, never an import.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["bf16_dtype"]


@functools.cache
def bf16_dtype() -> np.dtype:
    """The ``ml_dtypes.bfloat16`` numpy dtype (ml_dtypes is imported at the first call)."""
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
