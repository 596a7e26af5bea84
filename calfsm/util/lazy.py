"""The heavy dependencies of the core, imported at their first use.

Every process that embeds calfsm pays ``import calfsm`` at every start; these imports
would be most of it (measured on a 2-core VM: ml_dtypes ~0.6 s, several times the rest;
asyncio ~20 ms, for callers that may never use it). No module imports them at its top:
each asks the accessor here where it first needs the value. An accessor imports at its
first call and then returns the cached value (one cached call, never an import lookup),
so the per-token paths may call it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np

__all__ = ["asyncio_module", "bf16_dtype"]


@functools.cache
def bf16_dtype() -> np.dtype:
    """numpy's bfloat16 dtype (``ml_dtypes.bfloat16``; numpy has none of its own)."""
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


@functools.cache
def asyncio_module() -> ModuleType:
    """The asyncio module (the async twins of the blocking calls use it)."""
    import asyncio
    return asyncio
