"""Shared by the embeddings tests: the fixed embeddings prompt and manifests whose
embedding tensor has another dtype."""

from __future__ import annotations

import attrs
import ml_dtypes
import numpy as np

from calfsm.manifest import DType, Manifest, TaskKind, builtin_manifest

#: greedy tokens after :func:`golden_embeds` on the tiny manifest (V = 1024): the test
#: vector of docs/reference-model.md
EMBEDS_GOLDEN_TOKENS = [376, 848, 510, 852]


def golden_embeds(n: int = 17, hidden: int = 64, dtype=ml_dtypes.bfloat16) -> np.ndarray:
    """``e[i][j] = ((hidden i + j) mod 23 - 11) / 4``: exact in every float dtype."""
    return ((np.arange(n * hidden).reshape(n, hidden) % 23 - 11) / 4).astype(dtype)


def tiny_with_embeds_dtype(dtype: DType) -> Manifest:
    """The tiny manifest with its embedding tensor in ``dtype``."""
    m = builtin_manifest("tiny")
    subs = []
    for s in m.submodels:
        if s.kind is TaskKind.PREFILL_EMBEDS:
            t = s.token_or_embed
            s = attrs.evolve(s, token_or_embed=attrs.evolve(
                t, dtype=dtype, byte_size=t.element_count * dtype.itemsize))
        subs.append(s)
    return attrs.evolve(m, submodels=tuple(subs))
